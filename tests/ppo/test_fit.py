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


@pytest.mark.parametrize("micro,accum", [(1, 4), (2, 2), (4, 1)])
def test_actor_step_loss_is_global_token_mean(micro, accum):
    data = _experience()
    strategy = _strategy(micro, accum)
    engine = _prepare(strategy, Actor.from_pretrained(str(tiny_model_dir()), dtype=torch.float32))
    with torch.no_grad():
        data["old_log_probs"] = engine(data["sequences"], data["attention_mask"]).log_probs
    algo = AlgoConfig(advantage_estimator="reinforce", init_kl_coef=0.0)
    loss_fn = actor_loss(
        engine, algo, kl_coef=0.0, temperature=1.0, generate_max_len=8, is_correction=None, is_threshold=(0.5, 5.0)
    )
    metrics = fit_experience(
        engine,
        data,
        loss_fn,
        batching=Batching(rows=micro),
        rows_per_step=micro * accum,
        epochs=1,
        world_size=1,
        seed=0,
        device=strategy.device,
    )
    # ratio 1 everywhere: per-token loss = -A, so the step loss = -(sum of A over the 14 response tokens) / 14
    expected = -(data["advantages"] * data["action_mask"]).sum() / data["action_mask"].sum()
    assert metrics["train/policy_loss"] == pytest.approx(expected.item(), abs=1e-5)
    assert metrics["train/clip_ratio"] == 0.0


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
