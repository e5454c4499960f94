"""KL estimators and controllers against hand-computed values."""

import math

import pytest
import torch

from openppo.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    build_kl_controller,
    compute_approx_kl,
    kl_loss,
    sequence_kl,
)

DTYPES = [torch.float32, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES)
def test_estimators_hand_values(dtype):
    # x = log p - log p_ref = [0.5, -1.0, 0.0]
    log_probs = torch.tensor([[-1.0, -2.0, -0.3]], dtype=dtype)
    ref = torch.tensor([[-1.5, -1.0, -0.3]], dtype=dtype)
    k1 = compute_approx_kl(log_probs, ref, "k1")
    k2 = compute_approx_kl(log_probs, ref, "k2")
    k3 = compute_approx_kl(log_probs, ref, "k3")
    assert k1.dtype == dtype
    torch.testing.assert_close(k1, torch.tensor([[0.5, -1.0, 0.0]], dtype=dtype))
    # k2 = x^2 / 2 = [0.125, 0.5, 0]
    torch.testing.assert_close(k2, torch.tensor([[0.125, 0.5, 0.0]], dtype=dtype))
    # k3 = exp(-x) - 1 + x: exp(-0.5) - 0.5 = 0.6065307 - 0.5 = 0.1065307; exp(1) - 2 = 0.7182818; 0
    torch.testing.assert_close(k3, torch.tensor([[math.exp(-0.5) - 0.5, math.e - 2.0, 0.0]], dtype=dtype))


def test_k3_nonnegative_and_zero_when_equal():
    torch.manual_seed(0)
    log_probs = torch.randn(8, 16, dtype=torch.float64) * 3
    ref = torch.randn(8, 16, dtype=torch.float64) * 3
    assert (compute_approx_kl(log_probs, ref, "k3") >= 0).all()
    assert (compute_approx_kl(log_probs, log_probs.clone(), "k3") == 0).all()


def test_clamps_and_mask():
    # x = 100: k1 clamps to 10. x = -100: k3 would be exp(100); the log ratio is clamped to -20 first, then the
    # result to 10. Masked position holds -inf: result there is 0, not NaN.
    log_probs = torch.tensor([[0.0, -100.0, float("-inf")]])
    ref = torch.tensor([[-100.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    assert compute_approx_kl(log_probs, ref, "k1", mask=mask).tolist() == [[10.0, -10.0, 0.0]]
    assert compute_approx_kl(log_probs, ref, "k3", mask=mask).tolist() == [[10.0, 10.0, 0.0]]
    unclamped = compute_approx_kl(log_probs[:, :2], ref[:, :2], "k3", clamp=None)
    # x = -100 -> clamp -20: exp(20) - 1 - 20
    torch.testing.assert_close(unclamped[0, 1], torch.tensor(math.exp(20) - 21.0))


def test_unknown_estimator_is_a_value_error():
    with pytest.raises(ValueError, match=r"estimator='k4' is not one of k1, k2, k3"):
        compute_approx_kl(torch.zeros(1, 1), torch.zeros(1, 1), "k4")


def test_kl_loss_and_sequence_kl():
    log_probs = torch.tensor([[-1.0, -2.0, -5.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, 0.0]], requires_grad=True)
    mask = torch.tensor([[True, True, False]])
    loss = kl_loss(log_probs, ref, mask, "k2")
    loss.sum().backward()
    # d(x^2/2)/d log_probs = x = [0.5, -1.0], 0 where masked; the reference gets no gradient
    torch.testing.assert_close(log_probs.grad, torch.tensor([[0.5, -1.0, 0.0]]))
    assert ref.grad is None
    # k1 summed over kept tokens: 0.5 - 1.0 = -0.5
    kl = compute_approx_kl(log_probs, ref, "k1", mask=mask)
    assert sequence_kl(kl, mask).tolist() == [-0.5]
    assert not sequence_kl(kl, mask).requires_grad


def _expected_kl_loss_gradient(estimator: str, unbiased: bool, off_policy: bool) -> tuple[torch.Tensor, ...]:
    """Over one position with a 6-token vocabulary, sampled from pi_old: the exact expectation of the KL loss's
    gradient wrt the logits, sum_a pi_old(a) grad loss(a), and the exact gradients of the reverse and forward KL."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(6, generator=g, dtype=torch.float64).requires_grad_(True)
    ref = torch.randn(6, generator=g, dtype=torch.float64).log_softmax(-1)
    log_pi = logits.log_softmax(-1)
    old = (
        (log_pi + 0.3 * torch.randn(6, generator=g, dtype=torch.float64)).log_softmax(-1).detach()
        if off_policy
        else None
    )
    per_token = kl_loss(
        log_pi[:, None],
        ref[:, None],
        torch.ones(6, 1),
        estimator,
        unbiased_gradient=unbiased,
        old_log_probs=None if old is None else old[:, None],
    )[:, 0]
    weights = (log_pi.detach() if old is None else old).exp()
    (expected,) = torch.autograd.grad((weights * per_token).sum(), logits, retain_graph=True)
    pi = log_pi.exp()
    (reverse,) = torch.autograd.grad((pi * (log_pi - ref)).sum(), logits, retain_graph=True)
    (forward,) = torch.autograd.grad((ref.exp() * (ref - log_pi)).sum(), logits)
    return expected, reverse, forward, per_token


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("off_policy", [False, True])
def test_the_unbiased_kl_gradient_is_the_reverse_kls_in_expectation(estimator, off_policy):
    """Computed exactly, not sampled: with the correction every estimator's expected gradient is grad KL(pi || ref),
    on-policy and off (pi_old != pi, weights well under the cap); without it, on-policy, k1's is 0 and k3's the forward
    KL's, and k2's is right only on-policy (module docstring of openppo.algorithms.kl). The value is the estimator's."""
    expected, reverse, forward, per_token = _expected_kl_loss_gradient(estimator, True, off_policy)
    torch.testing.assert_close(expected, reverse, rtol=1e-10, atol=1e-12)
    plain, _, _, plain_value = _expected_kl_loss_gradient(estimator, False, off_policy)
    torch.testing.assert_close(per_token, plain_value, rtol=0, atol=0)
    assert reverse.abs().max() > 0.05 and (reverse - forward).abs().max() > 0.05
    if estimator == "k1" and not off_policy:
        torch.testing.assert_close(plain, torch.zeros_like(plain), rtol=0, atol=1e-12)
    elif estimator == "k3" and not off_policy:
        torch.testing.assert_close(plain, forward, rtol=1e-10, atol=1e-12)
    if estimator == "k2" and not off_policy:
        torch.testing.assert_close(plain, reverse, rtol=1e-10, atol=1e-12)
    else:
        assert (plain - reverse).abs().max() > 1e-3


def test_the_unbiased_kl_gradient_by_hand():
    """Per token: d loss / d log pi = min(pi / pi_old, 10) * (log pi - log pi_ref), 0 where masked (even over an
    infinite padding log-prob); the value is k3's."""
    log_probs = torch.tensor([[-1.0, -2.0, -0.5, -math.inf]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -0.5, -1.0]])
    old = torch.tensor([[-1.2, -2.0, -3.5, -1.0]])  # weights e^0.2, 1, e^3 -> capped at 10
    mask = torch.tensor([[1, 1, 1, 0]])
    loss = kl_loss(log_probs, ref, mask, "k3", unbiased_gradient=True, old_log_probs=old)
    loss.sum().backward()
    torch.testing.assert_close(log_probs.grad, torch.tensor([[math.exp(0.2) * 0.5, -1.0, 0.0, 0.0]]))
    k3 = [math.exp(-x) - 1 + x for x in (0.5, -1.0, 0.0)]
    torch.testing.assert_close(loss.detach(), torch.tensor([k3 + [0.0]]))
    log_probs.grad = None
    kl_loss(
        log_probs, ref + torch.tensor([[0.0, 0.0, 1.0, 0.0]]), mask, "k2", unbiased_gradient=True, old_log_probs=old
    )[:, 2].backward()
    torch.testing.assert_close(log_probs.grad[0, 2], torch.tensor(10.0 * -1.0))  # the capped weight


def test_fixed_controller():
    ctl = build_kl_controller(0.01)
    assert isinstance(ctl, FixedKLController)
    ctl.update(100.0, 512)
    assert ctl.value == 0.01
    with pytest.raises(ValueError, match="init_kl_coef must be >= 0"):
        FixedKLController(-0.1)


def test_adaptive_controller_hand_values():
    ctl = build_kl_controller(0.1, kl_target=6.0, kl_horizon=10000)
    assert isinstance(ctl, AdaptiveKLController)
    # KL 9 vs target 6: error = 9/6 - 1 = 0.5 -> clipped to 0.2; beta = 0.1 * (1 + 0.2 * 1000 / 10000) = 0.102
    ctl.update(9.0, 1000)
    assert ctl.value == pytest.approx(0.102)
    # KL 5.4: error = 0.9 - 1 = -0.1; beta = 0.102 * (1 - 0.1 * 500 / 10000) = 0.102 * 0.995 = 0.10149
    ctl.update(5.4, 500)
    assert ctl.value == pytest.approx(0.10149)
    restored = AdaptiveKLController(0.5, 6.0)
    restored.load_state_dict(ctl.state_dict())
    assert restored.value == ctl.value
    with pytest.raises(ValueError, match="kl_target must be > 0"):
        AdaptiveKLController(0.1, 0.0)
    with pytest.raises(ValueError, match="kl_horizon must be > 0"):
        AdaptiveKLController(0.1, 1.0, 0)


def test_adaptive_controller_is_fed_nats_per_response():
    # Two responses of 3 and 1 tokens; k1 per token [0.5, 0.5, 0.5] and [1.0]. Per response: 1.5 and 1.0, batch
    # mean 1.25 nats (what --kl_target counts); the per-token mean would be 2.5 / 4 = 0.625.
    kl = torch.tensor([[0.5, 0.5, 0.5], [1.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    per_response = sequence_kl(kl, mask).mean().item()
    assert per_response == pytest.approx(1.25)
    # target 1 nat: e = 1.25 - 1 = 0.25 -> clipped 0.2; beta = 0.1 * (1 + 0.2 * 2 / 10) = 0.104
    ctl = AdaptiveKLController(0.1, kl_target=1.0, kl_horizon=10)
    ctl.update(per_response, 2)
    assert ctl.value == pytest.approx(0.104)
    # target 2 nats: e = 1.25 / 2 - 1 = -0.375 -> -0.2; beta = 0.104 * (1 - 0.2 * 2 / 10) = 0.09984
    ctl.target = 2.0
    ctl.update(per_response, 2)
    assert ctl.value == pytest.approx(0.09984)


@pytest.mark.parametrize(
    "estimator,x_values,expected",
    [
        # x = log pi - log pi_ref on the kept tokens [0.5, -1.0]
        ("k1", [0.5, -1.0], [0.5, -1.0]),
        ("k2", [0.5, -1.0], [0.125, 0.5]),
        ("k3", [0.5, -1.0], [math.exp(-0.5) - 0.5, math.e - 2.0]),
    ],
)
def test_each_estimator_as_reward_penalty_and_as_loss(estimator, x_values, expected):
    from openppo.algorithms import aggregate_loss, token_level_rewards

    ref = torch.tensor([[-1.0, -1.0, -1.0]], dtype=torch.float64)
    log_probs = (ref + torch.tensor([[*x_values, 3.0]], dtype=torch.float64)).requires_grad_()
    mask = torch.tensor([[1, 1, 0]])
    # reward penalty: R_t = r 1[t last] - beta k_t, beta 0.1, reward 1 on the last kept token (index 1)
    kl = compute_approx_kl(log_probs.detach(), ref, estimator, mask=mask)
    rewards = token_level_rewards(torch.tensor([1.0], dtype=torch.float64), mask, kl, kl_coef=0.1)
    torch.testing.assert_close(
        rewards, torch.tensor([[-0.1 * expected[0], 1.0 - 0.1 * expected[1], 0.0]], dtype=torch.float64)
    )
    # loss term: token-mean of k over the 2 kept tokens; d/dx of k1 = 1, k2 = x, k3 = 1 - exp(-x), / 2 tokens
    loss = aggregate_loss(kl_loss(log_probs, ref, mask, estimator), mask, "token-mean")
    torch.testing.assert_close(loss, torch.tensor(sum(expected) / 2, dtype=torch.float64))
    loss.backward()
    slope = {"k1": lambda x: 1.0, "k2": lambda x: x, "k3": lambda x: 1.0 - math.exp(-x)}[estimator]
    torch.testing.assert_close(
        log_probs.grad, torch.tensor([[slope(x_values[0]) / 2, slope(x_values[1]) / 2, 0.0]], dtype=torch.float64)
    )
