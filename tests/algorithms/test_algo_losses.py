"""Policy and value losses against hand-computed values."""

import math

import pytest
import torch

from openppo.algorithms import gspo_sequence_log_ratio, importance_weights, policy_loss, value_loss

DTYPES = [torch.float32, torch.float64]


def _log(values, dtype=torch.float32):
    return torch.tensor(values, dtype=dtype).log()


@pytest.mark.parametrize("dtype", DTYPES)
def test_ppo_clip_hand_values(dtype):
    ratios = [[1.5, 0.5, 1.1, 1.0]]
    old = torch.zeros(1, 4, dtype=dtype)
    log_probs = _log(ratios, dtype)
    adv = torch.tensor([[1.0, 1.0, -1.0, -2.0]], dtype=dtype)
    mask = torch.ones(1, 4)
    loss, metrics = policy_loss(log_probs, old, adv, mask)
    # r=1.5, A=1: min(1.5, 1.2) = 1.2 (clipped)  -> -1.2
    # r=0.5, A=1: min(0.5, 0.8) = 0.5            -> -0.5
    # r=1.1, A=-1: min(-1.1, -1.1)               ->  1.1
    # r=1.0, A=-2:                               ->  2.0
    assert loss.dtype == dtype
    torch.testing.assert_close(loss, torch.tensor([[-1.2, -0.5, 1.1, 2.0]], dtype=dtype))
    torch.testing.assert_close(metrics["clip_ratio"], torch.tensor(0.25, dtype=dtype))
    # approx_kl = mean(r - 1 - log r) = (0.5 - ln 1.5 + (-0.5 - ln 0.5) + 0.1 - ln 1.1 + 0) / 4
    expected_kl = (0.5 - math.log(1.5) - 0.5 - math.log(0.5) + 0.1 - math.log(1.1)) / 4
    torch.testing.assert_close(metrics["approx_kl"], torch.tensor(expected_kl, dtype=dtype))


def test_asymmetric_clip_higher():
    old = torch.zeros(1, 2)
    log_probs = _log([[1.5, 0.5]])
    adv = torch.tensor([[1.0, -1.0]])
    loss, metrics = policy_loss(log_probs, old, adv, torch.ones(1, 2), eps_clip_low=0.2, eps_clip_high=0.28)
    # r=1.5, A=1: clip at 1.28 -> -1.28; r=0.5, A=-1: min(-0.5, -0.8) = -0.8 -> 0.8 (clipped at 1 - 0.2)
    torch.testing.assert_close(loss, torch.tensor([[-1.28, 0.8]]))
    assert metrics["clip_ratio"].item() == 1.0


def test_dual_clip_only_for_negative_advantages():
    old = torch.zeros(1, 3)
    log_probs = _log([[5.0, 5.0, 1.0]])
    adv = torch.tensor([[-1.0, 1.0, -1.0]])
    mask = torch.ones(1, 3)
    plain, _ = policy_loss(log_probs, old, adv, mask)
    dual, metrics = policy_loss(log_probs, old, adv, mask, dual_clip=3.0)
    # r=5, A=-1: -min(-5, -1.2) = 5 -> dual bound -3 * -1 = 3
    # r=5, A=+1: -min(5, 1.2) = -1.2, untouched (A > 0)
    # r=1, A=-1: 1 < 3, untouched
    torch.testing.assert_close(plain, torch.tensor([[5.0, -1.2, 1.0]]))
    torch.testing.assert_close(dual, torch.tensor([[3.0, -1.2, 1.0]]))
    torch.testing.assert_close(metrics["dual_clip_ratio"], torch.tensor(1 / 3))
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        policy_loss(log_probs, old, adv, mask, dual_clip=1.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cispo_clips_the_weight_not_the_gradient(dtype):
    ratios = [[1.5, 0.5, 1.1, 3.0]]
    old = torch.zeros(1, 4, dtype=dtype)
    log_probs = _log(ratios, dtype).requires_grad_(True)
    adv = torch.tensor([[1.0, 1.0, -1.0, 7.0]], dtype=dtype)
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, metrics = policy_loss(log_probs, old, adv, mask, loss_type="cispo", eps_clip_high=0.2)
    # weights sg(min(r, 1.2)) = [1.2, 0.5, 1.1]; l_t = -w A log pi; the masked token gives 0
    w = torch.tensor([[1.2, 0.5, 1.1, 0.0]], dtype=dtype)
    expected = -w * torch.tensor([[1.0, 1.0, -1.0, 0.0]], dtype=dtype) * _log([[1.5, 0.5, 1.1, 1.0]], dtype)
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(metrics["clip_ratio"], torch.tensor(1 / 3, dtype=dtype))
    loss.sum().backward()
    # d l_t / d log pi(t) = -w_t A_t: the clipped first token still pulls (PPO gives it no gradient)
    torch.testing.assert_close(log_probs.grad, torch.tensor([[-1.2, -0.5, 1.1, 0.0]], dtype=dtype))
    ppo_log_probs = _log(ratios, dtype).requires_grad_(True)
    policy_loss(ppo_log_probs, old, adv, mask)[0].sum().backward()
    assert ppo_log_probs.grad[0, 0].item() == 0
    with pytest.raises(ValueError, match="dual_clip bounds a clipped surrogate; cispo has none"):
        policy_loss(log_probs, old, adv, mask, loss_type="cispo", dual_clip=3.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gspo_ratio_is_geometric_mean(dtype):
    # token ratios [2, 0.5, 4] (4th token masked, ratio 1000 must not count): (2 * 0.5 * 4)^(1/3) = 4^(1/3)
    log_probs = _log([[2.0, 0.5, 4.0, 1000.0], [1.0, 1.0, 1.0, 1.0]], dtype)
    old = torch.zeros(2, 4, dtype=dtype)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    seq_ratio = gspo_sequence_log_ratio(log_probs, old, mask).exp()
    torch.testing.assert_close(seq_ratio, torch.tensor([4 ** (1 / 3), 1.0], dtype=dtype))
    adv = torch.tensor([[1.0] * 4, [-1.0] * 4], dtype=dtype)
    loss, _ = policy_loss(log_probs, old, adv, mask, loss_type="gspo", eps_clip_low=0.5, eps_clip_high=10.0)
    # every kept token of sequence 0 carries -s_0 * A = -1.5874; sequence 1: -(1 * -1) = 1
    s0 = 4 ** (1 / 3)
    torch.testing.assert_close(loss, torch.tensor([[-s0, -s0, -s0, 0.0], [1.0, 1.0, 0.0, 0.0]], dtype=dtype))
    # with the default clip 0.2 the sequence ratio 1.587 clips at 1.2 for A > 0
    loss, metrics = policy_loss(log_probs, old, adv, mask, loss_type="gspo")
    torch.testing.assert_close(loss[0, :3], torch.full((3,), -1.2, dtype=dtype))
    torch.testing.assert_close(metrics["clip_ratio"], torch.tensor(3 / 5, dtype=dtype))


def _rho_rows():
    """(old, rollout, mask) with rho = exp(old - rollout) = [0.25, 1, 8] in row 0 and [8, 8] in row 1 (third token
    masked): the importance-weight tests' rows."""
    return _log([[0.25, 1.0, 8.0], [8.0, 8.0, 1.0]]), torch.zeros(2, 3), torch.tensor([[1, 1, 1], [1, 1, 0]])


def test_importance_weights_hand_values():
    # band [0.5, 5]
    old, rollout, mask = _rho_rows()
    tis, m = importance_weights(old, rollout, mask, "tis", (0.5, 5.0))
    torch.testing.assert_close(tis, torch.tensor([[0.5, 1.0, 5.0], [5.0, 5.0, 0.0]]))
    # vllm_kl = mean(rollout - old) over 5 kept tokens = -(ln 0.25 + 0 + ln 8 + 2 ln 8) / 5
    torch.testing.assert_close(m["vllm_kl"], torch.tensor(-(math.log(0.25) + 3 * math.log(8.0)) / 5))
    torch.testing.assert_close(m["is_ratio_mean"], torch.tensor((0.5 + 1 + 5 + 5 + 5) / 5))
    icepop, m = importance_weights(old, rollout, mask, "icepop", (0.5, 5.0))
    torch.testing.assert_close(icepop, torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))
    torch.testing.assert_close(m["is_masked_ratio"], torch.tensor(4 / 5))
    # row 0: rho_seq = (0.25 * 1 * 8)^(1/3) = 1.26 in band -> token-truncated; row 1: rho_seq = 8 -> dropped
    seq, _ = importance_weights(old, rollout, mask, "seq-mask-tis", (0.5, 5.0))
    torch.testing.assert_close(seq, torch.tensor([[0.5, 1.0, 5.0], [0.0, 0.0, 0.0]]))
    with pytest.raises(ValueError, match="correction='tiss' is not one of"):
        importance_weights(old, rollout, mask, "tiss", (0.5, 5.0))
    with pytest.raises(ValueError, match="threshold: need 0 <= low < high"):
        importance_weights(old, rollout, mask, "tis", (5.0, 0.5))


def test_molt_importance_weights_hand_values():
    # band [0.5, 5]
    old, rollout, mask = _rho_rows()
    trunc, m = importance_weights(old, rollout, mask, "token-trunc", (0.5, 5.0))
    # only the upper tail is cut: 0.25 stays
    torch.testing.assert_close(trunc, torch.tensor([[0.25, 1.0, 5.0], [5.0, 5.0, 0.0]]))
    assert m["is_masked_ratio"].item() == 0
    # geo: row 0's geometric mean (0.25 * 1 * 8)^(1/3) = 1.26 is in band -> its token ratios, untruncated;
    # row 1's is 8 -> dropped
    geo, m = importance_weights(old, rollout, mask, "geo-mask", (0.5, 5.0))
    torch.testing.assert_close(geo, torch.tensor([[0.25, 1.0, 8.0], [0.0, 0.0, 0.0]]))
    torch.testing.assert_close(m["is_masked_ratio"], torch.tensor(2 / 5))
    # seq: the product, row 0 0.25 * 1 * 8 = 2 (in band), row 1 64 (out); with band [0.5, 1.5] row 0 drops too
    seq, _ = importance_weights(old, rollout, mask, "seq-mask", (0.5, 5.0))
    torch.testing.assert_close(seq, torch.tensor([[0.25, 1.0, 8.0], [0.0, 0.0, 0.0]]))
    seq, _ = importance_weights(old, rollout, mask, "seq-mask", (0.5, 1.5))
    assert seq.abs().sum().item() == 0
    geo, _ = importance_weights(old, rollout, mask, "geo-mask", (0.5, 1.5))  # 1.26 still in band
    torch.testing.assert_close(geo[0], torch.tensor([0.25, 1.0, 8.0]))


def test_policy_loss_with_is_correction():
    old = _log([[0.25, 1.0, 8.0]])
    log_probs = old.clone()  # ratio 1: base loss = -A
    adv = torch.ones(1, 3)
    loss, metrics = policy_loss(
        log_probs,
        old,
        adv,
        torch.ones(1, 3),
        rollout_log_probs=torch.zeros(1, 3),
        is_correction="tis",
        is_threshold=(0.5, 5.0),
    )
    torch.testing.assert_close(loss, torch.tensor([[-0.5, -1.0, -5.0]]))
    assert {"clip_ratio", "approx_kl", "is_ratio_mean", "vllm_kl"} <= set(metrics)
    with pytest.raises(ValueError):
        policy_loss(log_probs, old, adv, torch.ones(1, 3), is_correction="tis")


def test_policy_loss_masking_and_extremes():
    # masked positions hold inf / NaN-producing values: loss 0 there, no NaN anywhere
    log_probs = torch.tensor([[0.0, 50.0, float("inf")]])
    old = torch.tensor([[0.0, 0.0, 0.0]])
    adv = torch.tensor([[1.0, -1.0, float("nan")]])
    mask = torch.tensor([[1, 1, 0]])
    loss, metrics = policy_loss(log_probs, old, adv, mask)
    assert torch.isfinite(loss).all() and loss[0, 2] == 0
    # log ratio 50 is clamped to 20: loss = exp(20) for A = -1
    torch.testing.assert_close(loss[0, 1], torch.tensor(math.exp(20.0)))
    assert all(torch.isfinite(v) for v in metrics.values())
    with pytest.raises(ValueError, match="loss_type='grpo' is not one of"):
        policy_loss(log_probs, old, adv, mask, loss_type="grpo")
    with pytest.raises(ValueError, match="need 0 < eps_clip_low < 1"):
        policy_loss(log_probs, old, adv, mask, eps_clip_low=1.0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_value_loss_hand_values(dtype):
    values = torch.tensor([[1.0, 2.0, 5.0]], dtype=dtype)
    old = torch.tensor([[0.0, 1.0, 0.0]], dtype=dtype)
    returns = torch.tensor([[0.0, 3.0, 0.0]], dtype=dtype)
    mask = torch.tensor([[1, 1, 0]])
    loss, metrics = value_loss(values, old, returns, mask, value_clip=0.5)
    # tok 0: (1 - 0)^2 = 1; V_clip = 0 + 0.5 -> 0.25; 0.5 * max = 0.5
    # tok 1: (2 - 3)^2 = 1; V_clip = 1 + 0.5 = 1.5 -> 2.25; 0.5 * 2.25 = 1.125 (clipped term active)
    torch.testing.assert_close(loss, torch.tensor([[0.5, 1.125, 0.0]], dtype=dtype))
    torch.testing.assert_close(metrics["value_clip_ratio"], torch.tensor(0.5, dtype=dtype))
    unclipped, _ = value_loss(values, old, returns, mask, value_clip=None)
    torch.testing.assert_close(unclipped, torch.tensor([[0.5, 0.5, 0.0]], dtype=dtype))
    with pytest.raises(ValueError, match="value_clip must be > 0"):
        value_loss(values, old, returns, mask, value_clip=0.0)
