"""Gradients flow where they should (current log-probs, values, logits, per-token loss) and nowhere else."""

import torch

from openppo.algorithms import (
    aggregate_loss,
    compute_approx_kl,
    compute_gae,
    compute_returns,
    kl_loss,
    policy_loss,
    shape_group_rewards,
    shape_sequence_rewards,
    token_level_rewards,
    value_loss,
    whiten_advantages,
)


def _leaf(*shape, scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).requires_grad_(True)


MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])


def test_policy_loss_gradient_only_to_log_probs():
    for loss_type in ("ppo", "gspo"):
        log_probs, old, adv, rollout = (
            _leaf(2, 4, scale=0.1),
            _leaf(2, 4, scale=0.1, seed=1),
            _leaf(2, 4, seed=2),
            _leaf(2, 4, scale=0.1, seed=3),
        )
        loss, metrics = policy_loss(
            log_probs,
            old,
            adv,
            MASK,
            loss_type=loss_type,
            rollout_log_probs=rollout,
            is_correction="tis",
            dual_clip=3.0,
        )
        aggregate_loss(loss, MASK).backward()
        assert old.grad is None and adv.grad is None and rollout.grad is None
        assert (log_probs.grad[MASK.bool()] != 0).any()
        assert (log_probs.grad[~MASK.bool()] == 0).all()
        assert not any(v.requires_grad for v in metrics.values())


def test_ppo_gradient_is_ratio_times_advantage():
    # unclipped tokens: d(-r A)/d log pi = -r A; with r = 1 (log_probs = old) that is -A, then /N for token-mean
    log_probs = torch.zeros(1, 3, dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[1.0, -2.0, 0.5]], dtype=torch.float64)
    loss, _ = policy_loss(log_probs, torch.zeros(1, 3, dtype=torch.float64), adv, torch.ones(1, 3))
    aggregate_loss(loss, torch.ones(1, 3)).backward()
    torch.testing.assert_close(log_probs.grad, -adv / 3)


def test_value_loss_gradient_only_to_values():
    values, old, returns = _leaf(2, 4), _leaf(2, 4, seed=1), _leaf(2, 4, seed=2)
    loss, _ = value_loss(values, old, returns, MASK, value_clip=0.2)
    loss.sum().backward()
    assert old.grad is None and returns.grad is None
    assert (values.grad[~MASK.bool()] == 0).all() and (values.grad != 0).any()


def test_value_loss_clipped_token_has_no_gradient():
    # V = 2, V_old = 1, R = 3: the clipped term (1.5 - 3)^2 is the larger and it is constant in V
    values = torch.tensor([[2.0, 1.0]], requires_grad=True)
    loss, _ = value_loss(values, torch.tensor([[1.0, 0.0]]), torch.tensor([[3.0, 0.0]]), torch.ones(1, 2), 0.5)
    loss.sum().backward()
    # token 1: unclipped 0.5 (V - R)^2 with V - R = 1 is active -> gradient 1
    assert values.grad.tolist() == [[0.0, 1.0]]


def test_targets_are_detached():
    rewards, values = _leaf(2, 4), _leaf(2, 4, seed=1)
    adv, ret = compute_gae(rewards, values, MASK, 0.9, 0.95)
    outputs = [
        adv,
        ret,
        compute_returns(rewards, MASK, 0.9),
        whiten_advantages(values, MASK),
        token_level_rewards(_leaf(2), MASK, _leaf(2, 4), 0.1),
        shape_group_rewards(_leaf(4), 2, "group_norm"),
        shape_sequence_rewards(_leaf(4), estimator="rloo", n_samples_per_prompt=2, reward_clip_range=(-1.0, 1.0)),
    ]
    assert not any(t.requires_grad for t in outputs)


def test_kl_gradients():
    log_probs, ref = _leaf(2, 4, scale=0.1), _leaf(2, 4, scale=0.1, seed=1)
    kl_loss(log_probs, ref, MASK, "k3").sum().backward()
    assert ref.grad is None and (log_probs.grad[MASK.bool()] != 0).all()
    log_probs.grad = None
    # the generic estimator differentiates both sides: k1 = x -> +1 and -1
    compute_approx_kl(log_probs, ref, "k1", mask=MASK).sum().backward()
    torch.testing.assert_close(log_probs.grad, MASK.double())
    torch.testing.assert_close(ref.grad, -MASK.double())


def test_aggregate_loss_gradient_is_mask_over_normaliser():
    loss = _leaf(2, 4)
    aggregate_loss(loss, MASK, num_tokens_global=10).backward()
    torch.testing.assert_close(loss.grad, MASK.double() / 10)
    loss.grad = None
    # seq-mean-token-mean: 1 / (n_i * M) with n = [3, 2], M = 4
    aggregate_loss(loss, MASK, "seq-mean-token-mean", num_seqs_global=4).backward()
    torch.testing.assert_close(loss.grad, MASK.double() / torch.tensor([[3.0], [2.0]], dtype=torch.float64) / 4)
