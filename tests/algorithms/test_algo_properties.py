"""Property tests (hypothesis) of the invariants the hand-computed tests pin on single examples."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from openppo.algorithms import (
    aggregate_loss,
    compute_approx_kl,
    compute_gae,
    compute_returns,
    loss_normalizers,
    policy_loss,
    shape_group_rewards,
)

SETTINGS = settings(max_examples=25, deadline=None)
finite = st.floats(-5, 5, allow_nan=False, width=32)


def _tensor(values, shape):
    return torch.tensor(values, dtype=torch.float64).reshape(shape)


@SETTINGS
@given(st.lists(st.tuples(finite, finite), min_size=1, max_size=20))
def test_k3_nonnegative(pairs):
    log_probs = torch.tensor([p for p, _ in pairs], dtype=torch.float64)
    ref = torch.tensor([q for _, q in pairs], dtype=torch.float64)
    assert (compute_approx_kl(log_probs, ref, "k3") >= 0).all()
    assert (compute_approx_kl(log_probs, log_probs, "k3") == 0).all()


@SETTINGS
@given(st.integers(2, 6), st.integers(1, 4), st.data())
def test_group_shapes(n, groups, data):
    rewards = _tensor(data.draw(st.lists(finite, min_size=n * groups, max_size=n * groups)), (-1,))
    centred = rewards.view(-1, n) - rewards.view(-1, n).mean(1, keepdim=True)
    for estimator in ("rloo", "reinforce_baseline", "dr_grpo", "group_norm"):
        shaped = shape_group_rewards(rewards, n, estimator).view(-1, n)
        assert torch.isfinite(shaped).all()
        assert torch.allclose(shaped.sum(1), torch.zeros(groups, dtype=torch.float64), atol=1e-9)
    # RLOO is the mean-centred reward scaled by n / (n - 1)
    torch.testing.assert_close(shape_group_rewards(rewards, n, "rloo").view(-1, n), centred * n / (n - 1))


@SETTINGS
@given(st.integers(1, 3), st.integers(1, 6), st.floats(0, 1), st.data())
def test_gae_lambda_one_equals_returns_minus_values(batch, length, gamma, data):
    rewards = _tensor(data.draw(st.lists(finite, min_size=batch * length, max_size=batch * length)), (batch, length))
    values = _tensor(data.draw(st.lists(finite, min_size=batch * length, max_size=batch * length)), (batch, length))
    lengths = data.draw(st.lists(st.integers(0, length), min_size=batch, max_size=batch))
    mask = torch.tensor([[t < n for t in range(length)] for n in lengths])
    adv, ret = compute_gae(rewards, values, mask, gamma, 1.0)
    torch.testing.assert_close(adv, torch.where(mask, compute_returns(rewards, mask, gamma) - values, 0.0))
    torch.testing.assert_close(ret, torch.where(mask, adv + values, 0.0))


@SETTINGS
@given(st.lists(st.integers(0, 5), min_size=2, max_size=8), st.data())
def test_token_mean_over_any_split(lengths, data):
    width = 6
    mask = torch.tensor([[t < n for t in range(width)] for n in lengths])
    loss = _tensor(
        data.draw(st.lists(finite, min_size=len(lengths) * width, max_size=len(lengths) * width)), (len(lengths), width)
    )
    cut = data.draw(st.integers(1, len(lengths) - 1))
    parts = [(loss[:cut], mask[:cut]), (loss[cut:], mask[cut:])]
    num_tokens, num_seqs = sum(loss_normalizers(m) for _, m in parts).tolist()
    for mode in ("token-mean", "seq-mean-token-mean"):
        whole = aggregate_loss(loss, mask, mode)
        split = sum(
            aggregate_loss(part, m, mode, num_tokens_global=num_tokens, num_seqs_global=num_seqs) for part, m in parts
        )
        torch.testing.assert_close(split, whole)


@SETTINGS
@given(st.lists(st.tuples(st.floats(-3, 3), st.floats(-2, 2)), min_size=1, max_size=12))
def test_dual_clip_never_touches_nonnegative_advantages(pairs):
    log_ratio = torch.tensor([[r for r, _ in pairs]], dtype=torch.float64)
    adv = torch.tensor([[a for _, a in pairs]], dtype=torch.float64)
    mask = torch.ones_like(adv)
    old = torch.zeros_like(adv)
    plain, _ = policy_loss(log_ratio, old, adv, mask)
    dual, _ = policy_loss(log_ratio, old, adv, mask, dual_clip=3.0)
    keep = adv >= 0
    assert torch.equal(plain[keep], dual[keep])
    assert (dual <= plain).all()
    assert (dual[~keep] <= -3.0 * adv[~keep] + 1e-12).all()
