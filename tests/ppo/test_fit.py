"""The shared actor/critic loop on real DeepSpeed (1 rank): the step loss is one exact token-mean."""

from __future__ import annotations

import pytest
import torch

from openppo.models.actor import Actor
from openppo.models.scalar import ScalarModel
from openppo.ppo.batching import Batching
from openppo.ppo.config import AlgoConfig
from openppo.ppo.fit import actor_loss, critic_loss, fit_experience
from openppo.strategy.config import DeepSpeedConfig
from openppo.strategy.deepspeed_strategy import DeepSpeedStrategy
from tests.model_cache import tiny_model_dir
from tests.ppo.rank_helpers import train_engine


def _experience():
    torch.manual_seed(0)
    seqs = torch.randint(10, 1000, (4, 9))
    attn = torch.ones_like(seqs)
    attn[1, 6:] = 0
    attn[3, 4:] = 0
    mask = torch.zeros(4, 8, dtype=torch.long)  # ragged responses: 5, 2, 6, 1 tokens
    for row, (start, end) in enumerate([(3, 8), (3, 5), (2, 8), (2, 3)]):
        mask[row, start:end] = 1
    advantages = torch.randn(4, 8) * mask
    return {"sequences": seqs, "attention_mask": attn, "action_mask": mask, "advantages": advantages}


def _strategy(micro, accum, stage=0):
    s = DeepSpeedStrategy(
        DeepSpeedConfig(zero_stage=stage, param_dtype="fp32", dist_timeout=120),
        train_batch_size=micro * accum,
        micro_batch_size=micro,
        max_norm=1.0,
        seed=0,
    )
    s.setup_distributed()
    return s


def _prepare(strategy, model):
    return train_engine(strategy, model, lr=1e-4, steps=4)


def _actor(micro: int, accum: int):
    """The tiny actor under one fp32 rank (ZeRO-0) and the batch of `_experience`."""
    strategy = _strategy(micro, accum)
    return strategy, _prepare(strategy, Actor.from_pretrained(str(tiny_model_dir()), dtype=torch.float32))


def _actor_step(strategy, engine, data, batching: Batching, **algo) -> dict[str, float]:
    """One optimizer step over the 4 rows with the PPO loss of `AlgoConfig(**algo)`."""
    loss_fn = actor_loss(
        engine,
        AlgoConfig(advantage_estimator="reinforce", init_kl_coef=0.0, **algo),
        kl_coef=0.0,
        temperature=1.0,
        generate_max_len=8,
        is_correction=None,
        is_threshold=(0.5, 5.0),
    )
    step = dict(batching=batching, rows_per_step=4, epochs=1, world_size=1, seed=0, device=strategy.device)
    return fit_experience(engine, data, loss_fn, **step)


@pytest.mark.parametrize("micro,accum", [(1, 4), (2, 2), (4, 1)])
def test_actor_step_loss_is_global_token_mean(micro, accum):
    data = _experience()
    strategy, engine = _actor(micro, accum)
    with torch.no_grad():
        data["old_log_probs"] = engine(data["sequences"], data["attention_mask"]).log_probs
    metrics = _actor_step(strategy, engine, data, Batching(rows=micro))
    # ratio 1 everywhere: per-token loss = -A, so the step loss = -(sum of A over the 14 response tokens) / 14
    expected = -(data["advantages"] * data["action_mask"]).sum() / data["action_mask"].sum()
    assert metrics["train/policy_loss"] == pytest.approx(expected.item(), abs=1e-5)
    assert metrics["train/clip_ratio"] == 0.0


@pytest.mark.parametrize("batching", [Batching(rows=1), Batching(rows=3), Batching(packed=True, max_tokens=12)])
def test_logged_means_are_token_means_of_the_step(batching):
    """train/entropy, train/approx_kl, train/clip_ratio are means over the step's response tokens, whatever the
    micro-batches (here of 5, 2, 6 and 1 tokens: a mean of micro-batch means would weigh the 1-token row as much as
    the 6-token one), checked against one plain forward over all rows."""
    data = _experience()
    strategy, engine = _actor(1, 4)
    mask = data["action_mask"].bool()
    with torch.no_grad():
        out = engine(data["sequences"], data["attention_mask"], return_entropy="log")
    shift = 0.3 * torch.randn(mask.shape, generator=torch.Generator().manual_seed(3))
    data["old_log_probs"] = out.log_probs - shift  # log ratio = shift on every token
    metrics = _actor_step(strategy, engine, data, batching, eps_clip=0.2)
    x, adv = shift[mask], data["advantages"][mask]  # k3 of KL(pi_old || pi) with x = log(pi / pi_old)
    ratio = shift[mask].exp()
    clipped = torch.where(adv >= 0, ratio > 1.2, ratio < 0.8)  # where the clipped surrogate is the smaller one
    assert metrics["train/entropy"] == pytest.approx(out.entropy[mask].mean().item(), rel=1e-6)
    assert metrics["train/approx_kl"] == pytest.approx((x.expm1() - x).mean().item(), abs=1e-6)
    assert metrics["train/clip_ratio"] == pytest.approx(clipped.float().mean().item(), abs=1e-6)


def test_the_kl_loss_takes_the_unbiased_gradient():
    """--kl_unbiased_gradient reaches the actor's loss: with zero advantages the micro-batch's gradient is beta times
    the token-mean of min(pi / pi_old, 10) (log pi - log pi_ref) grad log pi, computed here from a plain forward;
    the logged KL loss is still k3's mean."""
    data = _experience()
    data["advantages"].zero_()
    model = Actor.from_pretrained(str(tiny_model_dir()), dtype=torch.float32)  # (no engine: grads by autograd)
    mask = data["action_mask"].bool()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        log_probs = model(data["sequences"], data["attention_mask"]).log_probs
    data["old_log_probs"] = log_probs - 0.3 * torch.randn(mask.shape, generator=g)
    data["ref_log_probs"] = log_probs + 0.5 * torch.randn(mask.shape, generator=g)
    algo = AlgoConfig(
        advantage_estimator="reinforce",
        init_kl_coef=0.1,
        use_kl_loss=True,
        kl_estimator="k3",
        kl_unbiased_gradient=True,
        loss_agg_mode="token-mean",
    )
    loss_fn = actor_loss(
        model, algo, kl_coef=0.1, temperature=1.0, generate_max_len=8, is_correction=None, is_threshold=(0.5, 5.0)
    )
    n = int(mask.sum())
    params = [p for p in model.parameters() if p.requires_grad]
    loss, metrics = loss_fn(data, torch.tensor([n, 4]))
    got = torch.autograd.grad(loss, params)
    fresh = model(data["sequences"], data["attention_mask"]).log_probs
    x = fresh.detach() - data["ref_log_probs"]
    w = (fresh.detach() - data["old_log_probs"]).exp().clamp(max=10.0)
    want = torch.autograd.grad((w * x * fresh)[mask].sum() * (0.1 / n), params)
    for grad, expected in zip(got, want):
        torch.testing.assert_close(grad, expected, rtol=1e-4, atol=1e-7)
    assert max(g.abs().max().item() for g in got) > 1e-4
    assert metrics["train/kl_loss"] == pytest.approx((x.neg().expm1() + x)[mask].mean().item(), rel=1e-5)


def test_critic_learns_returns():
    data = _experience()
    data["returns"] = torch.full((4, 8), 2.0)
    strategy = _strategy(2, 2)
    engine = _prepare(
        strategy, ScalarModel.from_pretrained(str(tiny_model_dir()), dtype=torch.float32, flag="--critic_pretrain")
    )
    with torch.no_grad():
        data["old_values"] = engine(data["sequences"], data["attention_mask"])[:, :-1]
    loss_fn = critic_loss(engine, AlgoConfig(value_clip=None))
    first = fit_experience(
        engine,
        data,
        loss_fn,
        batching=Batching(rows=2),
        rows_per_step=4,
        epochs=1,
        world_size=1,
        seed=0,
        device=strategy.device,
    )["train/value_loss"]
    later = fit_experience(
        engine,
        data,
        loss_fn,
        batching=Batching(rows=2),
        rows_per_step=4,
        epochs=20,
        world_size=1,
        seed=1,
        device=strategy.device,
    )["train/value_loss"]
    assert later < 0.5 * first


def test_shared_prompt_updates_equal_the_packed_ones():
    """--share_prompt_in_group in the update: an actor and a critic step over 3 groups (long prompts, 2-3 rows
    each) with a token budget, each prompt computed once per micro-batch, against the same step on plain packed
    rows: the same losses and the same weights after it (fp32)."""
    from openppo.models.row_layout import RowLayout
    from tests.ppo.rank_helpers import grouped_rows

    data = grouped_rows([(30, [4, 7, 2]), (22, [5, 3]), (35, [6, 1, 3])])
    gen = torch.Generator().manual_seed(2)
    data["advantages"] = torch.randn(data["action_mask"].shape, generator=gen) * data["action_mask"]
    data["returns"] = torch.randn(data["action_mask"].shape, generator=gen) * data["action_mask"]
    results = {}
    for share in (False, True):
        strategy = _strategy(8, 1)
        actor = _prepare(strategy, Actor.from_pretrained(str(tiny_model_dir()), dtype=torch.float32))
        critic = _prepare(
            strategy, ScalarModel.from_pretrained(str(tiny_model_dir()), dtype=torch.float32, flag="--critic_pretrain")
        )
        for engine in (actor, critic):
            engine.module.layout = RowLayout(packed=True, share_prompts=share)
        batching = Batching(packed=True, max_tokens=80, share_prompts=share)  # several micro-batches
        step = dict(batching=batching, rows_per_step=8, epochs=1, world_size=1, seed=0, device=strategy.device)
        with torch.no_grad():
            data["old_log_probs"] = actor(data["sequences"], data["attention_mask"], score_mask=data["action_mask"])[0]
            data["old_values"] = torch.zeros_like(data["returns"])
        algo = AlgoConfig(advantage_estimator="group_norm", init_kl_coef=0.0, value_clip=None)
        actor_metrics = fit_experience(
            actor,
            data,
            actor_loss(
                actor,
                algo,
                kl_coef=0.0,
                temperature=1.0,
                generate_max_len=8,
                is_correction=None,
                is_threshold=(0.5, 5.0),
            ),
            **step,
        )
        critic_metrics = fit_experience(critic, data, critic_loss(critic, algo), **step)
        weights = {f"actor.{n}": p.detach().clone() for n, p in actor.module.named_parameters()}
        weights.update({f"critic.{n}": p.detach().clone() for n, p in critic.module.named_parameters()})
        results[share] = {**actor_metrics, **critic_metrics}, weights
    (plain, plain_w), (shared, shared_w) = results[False], results[True]
    for key in ("train/policy_loss", "train/entropy", "train/value_loss"):
        assert shared[key] == pytest.approx(plain[key], abs=1e-6), key
    assert shared["perf/shared_prompt_share"] > 0.4  # 45 % of the row tokens: prompts computed once
    # one Adam step of lr 1e-4 moves every weight by about 1e-4 whatever its gradient's size, so the float noise of
    # a near-zero gradient can move an element visibly (measured: one gate_proj element 1.1e-5 apart, all else
    # < 1e-6); the gradients themselves are compared to 1e-5 in tests/models/test_shared_prompts.py
    worst = max((plain_w[n] - shared_w[n]).abs().max().item() for n in plain_w)
    assert worst < 2e-5, worst
