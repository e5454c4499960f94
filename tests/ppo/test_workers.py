"""The RL model workers in-process, without Ray, on real DeepSpeed (1 rank, ZeRO-3): reference equals the untrained
policy, training moves the policy, the critic and reward model give per-token values and per-sequence scores."""

from __future__ import annotations

import pytest
import torch

from openppo.config.schema import parse_config
from openppo.ppo.config import PPOConfig
from openppo.ppo.experience import collate_samples
from openppo.ppo.plan import make_plan
from openppo.ppo.workers import ActorWorker, CriticWorker, ReferenceWorker, RewardWorker
from openppo.rollout.pool import Sample
from tests.model_cache import tiny_model_dir


@pytest.fixture(scope="module")
def cfg():
    model = str(tiny_model_dir())
    return parse_config(
        PPOConfig,
        [
            "--pretrain",
            model,
            "--reward_pretrain",
            model,
            "--prompt_data",
            "x",
            "--zero_stage",
            "3",
            "--param_dtype",
            "fp32",
            "--rollout_batch_size",
            "4",
            "--train_batch_size",
            "4",
            "--micro_train_batch_size",
            "2",
            "--micro_rollout_batch_size",
            "3",
            "--actor_learning_rate",
            "1e-3",
            "--lr_warmup_ratio",
            "0",
            "--temperature",
            "0.7",
        ],
        "t",
    )


@pytest.fixture(scope="module")
def batch():
    torch.manual_seed(0)
    samples = [
        Sample(
            prompt_ids=torch.randint(10, 900, (p,)).tolist(),
            response_ids=torch.randint(10, 900, (r,)).tolist(),
            rollout_log_probs=[0.0] * r,
            finish_reason="stop",
            group=0,
        )
        for p, r in [(3, 4), (5, 2), (2, 6), (4, 3)]
    ]
    return collate_samples(samples, pad_token_id=0)


def _ready(worker, cfg, role: str):
    worker.setup(cfg, make_plan(cfg, num_prompts=4).roles[role])
    return worker


def test_workers(cfg, batch):
    data = {k: batch[k] for k in ("sequences", "attention_mask")}
    policy = _ready(ActorWorker(), cfg, "actor")
    reference = _ready(ReferenceWorker(), cfg, "reference")
    old = policy.log_probs(data)
    assert old.shape == batch["action_mask"].shape
    assert torch.allclose(old, reference.log_probs(data), atol=1e-6)
    # The temperature is applied: scoring at 0.7 differs from 1.0.
    cfg.rollout.temperature = 1.0
    assert not torch.allclose(old, policy.log_probs(data), atol=1e-4)
    cfg.rollout.temperature = 0.7
    train = {**batch, "old_log_probs": old, "advantages": torch.ones_like(old) * batch["action_mask"]}
    metrics = policy.train(train, kl_coef=0.0, global_step=1)
    assert {"train/policy_loss", "train/clip_ratio", "train/approx_kl"} <= set(metrics)
    new = policy.log_probs(data)
    mask = batch["action_mask"].bool()
    assert (new[mask] - old[mask]).mean() > 0  # positive advantages raise the log-probs of the taken tokens

    critic = _ready(CriticWorker(), cfg, "critic")
    values = critic.values(data)
    assert values.shape == batch["action_mask"].shape
    scores = _ready(RewardWorker(), cfg, "reward").scores(data)
    assert scores.shape == (4,)
    # the reward role reads the critic-identical head at each row's last real token
    last = batch["attention_mask"].sum(-1) - 1
    with torch.no_grad():
        full = critic.engine(batch["sequences"], batch["attention_mask"])
    assert torch.allclose(scores, full[torch.arange(4), last], atol=1e-5)
    # values live on the action grid: every position before a next token (micro-batches are trimmed to their own
    # longest row, so what lies beyond is zero)
    before_next = batch["attention_mask"][:, 1:].bool()
    assert torch.allclose(values[before_next], full[:, :-1][before_next], atol=1e-5)


SETUP_RANKS = """
import os, sys, torch
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
from openppo.config.schema import parse_config
from openppo.ppo.config import PPOConfig
from openppo.ppo.plan import make_plan
from openppo.ppo.workers import make_strategy
argv = ["--pretrain", sys.argv[2], "--prompt_data", "x", "--init_kl_coef", "0.01", "--param_dtype", "fp32"]
cfg = parse_config(PPOConfig, argv + sys.argv[3:], "t")
roles = make_plan(cfg, num_prompts=8).roles
for name in ("actor", "reference"):
    make_strategy(cfg, roles[name]).setup_distributed()
    print(name, torch.are_deterministic_algorithms_enabled())
"""


@pytest.mark.parametrize("flags", [[], ["--full_determinism"]])
def test_full_determinism_makes_the_trainer_ranks_deterministic(flags):
    """--full_determinism reseeded only the engines' sampling; the trainer ranks (trained and frozen) ran torch's
    nondeterministic kernels, as in a run without it. A subprocess: the setting is global to torch."""
    import subprocess
    import sys

    from openppo.strategy.distributed import free_port

    proc = subprocess.run(
        [sys.executable, "-c", SETUP_RANKS, str(free_port()), str(tiny_model_dir()), *flags],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    on = bool(flags)
    assert proc.stdout.split()[-4:] == ["actor", str(on), "reference", str(on)], proc.stdout
