"""Packing and token-budget micro-batches change how a step is computed, never its loss or gradient.

Real DeepSpeed (1 rank, ZeRO-0, fp32). The gradient is read at the accumulation boundary, before the optimizer
consumes it, by a thin wrapper around the engine's `step`.
"""

from __future__ import annotations

import pytest
import torch

from openppo.models.actor import Actor
from openppo.models.row_layout import RowLayout
from openppo.models.scalar import ScalarModel
from openppo.ppo.batching import Batching
from openppo.ppo.config import AlgoConfig
from openppo.ppo.fit import actor_loss, critic_loss, fit_experience
from openppo.strategy.config import DeepSpeedConfig
from openppo.strategy.deepspeed_strategy import DeepSpeedStrategy
from tests.model_cache import tiny_model_dir
from tests.ppo.rank_helpers import GradAtBoundary, train_engine

LENGTHS = [5, 17, 9, 30, 12, 3, 22, 8]  # ragged rows: prompt + response


def _experience() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    width = max(LENGTHS)
    seqs = torch.randint(10, 1000, (len(LENGTHS), width))
    attn = torch.zeros_like(seqs)
    mask = torch.zeros(len(LENGTHS), width - 1, dtype=torch.long)
    for row, n in enumerate(LENGTHS):
        attn[row, :n] = 1
        mask[row, 1 : n - 1] = 1  # the first token is the prompt
    seqs[attn == 0] = 0
    return {
        "sequences": seqs,
        "attention_mask": attn,
        "action_mask": mask,
        "advantages": torch.randn(len(LENGTHS), width - 1) * mask,
        "returns": torch.randn(len(LENGTHS), width - 1) * mask,
    }


def _engine(model_cls):
    strategy = DeepSpeedStrategy(
        DeepSpeedConfig(zero_stage=0, param_dtype="fp32", dist_timeout=120),
        train_batch_size=8,
        micro_batch_size=2,
        max_norm=1.0,
        seed=0,
    )
    strategy.setup_distributed()
    path = str(tiny_model_dir())
    model = (
        Actor.from_pretrained(path, dtype=torch.float32)
        if model_cls is Actor
        else ScalarModel.from_pretrained(path, dtype=torch.float32, flag="--critic_pretrain")
    )
    engine = train_engine(strategy, model, lr=1e-4, steps=4)
    return GradAtBoundary(engine), strategy


def _run(model_cls, batching: Batching, old: str = "noisy"):
    """`old`: "noisy" old log-probs (ratios != 1: clipping is live), "exact" (the policy's own), or "none" (the
    update uses its own, detached: one on-policy step)."""
    data = _experience()
    engine, strategy = _engine(model_cls)
    if model_cls is Actor:
        with torch.no_grad():
            data["old_log_probs"] = engine(data["sequences"], data["attention_mask"]).log_probs
        if old == "noisy":
            data["old_log_probs"] += 0.05 * torch.randn_like(data["old_log_probs"])
        elif old == "none":
            del data["old_log_probs"]
        loss_fn = actor_loss(
            engine,
            AlgoConfig(advantage_estimator="reinforce", init_kl_coef=0.0),
            kl_coef=0.0,
            temperature=1.0,
            generate_max_len=32,
            is_correction=None,
            is_threshold=(0.5, 5.0),
        )
    else:
        with torch.no_grad():
            data["old_values"] = engine(data["sequences"], data["attention_mask"])[:, :-1]
        loss_fn = critic_loss(engine, AlgoConfig(value_clip=0.2))
    engine.module.layout = RowLayout(packed=batching.packed)  # the old log-probs and values above: padded
    metrics = fit_experience(
        engine,
        data,
        loss_fn,
        batching=batching,
        rows_per_step=8,
        epochs=1,
        world_size=1,
        seed=0,
        device=strategy.device,
    )
    assert len(engine.grads) == 1
    return metrics, engine.grads[0]


@pytest.mark.parametrize("model_cls,loss_key", [(Actor, "train/policy_loss"), (ScalarModel, "train/value_loss")])
def test_packed_and_token_budget_steps_equal_static_padded(model_cls, loss_key):
    ref_metrics, ref_grads = _run(model_cls, Batching(rows=2))
    for batching in (
        Batching(packed=True, rows=2),  # packing alone
        Batching(rows=2, max_tokens=40),  # dynamic, padded cost
        Batching(packed=True, rows=2, max_tokens=40),
    ):  # dynamic + packing
        metrics, grads = _run(model_cls, batching)
        assert metrics[loss_key] == pytest.approx(ref_metrics[loss_key], abs=1e-6), batching
        worst = max((grads[n] - g).abs().max().item() for n, g in ref_grads.items())
        scale = max(g.abs().max().item() for g in ref_grads.values())
        assert worst <= 1e-5 * max(scale, 1.0), (batching, worst)


def test_one_on_policy_step_needs_no_old_log_prob_pass():
    """The update's own detached log-probs as the old ones: the same loss and gradient as a separate pass."""
    ref_metrics, ref_grads = _run(Actor, Batching(packed=True, rows=2), old="exact")
    metrics, grads = _run(Actor, Batching(packed=True, rows=2), old="none")
    assert metrics["train/policy_loss"] == pytest.approx(ref_metrics["train/policy_loss"], abs=1e-6)
    assert metrics["train/clip_ratio"] == ref_metrics["train/clip_ratio"] == 0.0
    worst = max((grads[n] - g).abs().max().item() for n, g in ref_grads.items())
    assert worst <= 1e-5 * max(max(g.abs().max().item() for g in ref_grads.values()), 1.0), worst
