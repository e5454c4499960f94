"""A resumed model is the model that was saved: weights, optimizer state, LR schedule and step, bit for bit.

Two spawned gloo ranks (one module fixture), fp32, ZeRO-2 and ZeRO-3, for the actor, a LoRA actor and the critic.
Each case trains two optimizer steps (so Adam's moments and the warm-up schedule have moved), takes a snapshot
of the live engine, saves through `DeepSpeedStrategy.save_checkpoint` (what the RL roles call), loads the folder
into a second engine built from scratch, and compares it with the snapshot: every full (gathered) weight, every
tensor of this rank's optimizer state, the LR scheduler's state and DeepSpeed's step counter. Then both engines
train one more step on the same rows: the weights must still be equal, so the resumed run continues the saved one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.ppo.rank_helpers import fp32_strategy, full_weights, join_gloo_group, load_model, ragged_rows
from tests.spawn import run_ranks

WORLD = 2
TIMEOUT_S = 600
ROLES = ("actor", "lora", "critic")
LENGTHS = [9, 14, 6, 11, 12, 7, 10, 13]


def _batch(vocab: int, rank: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * seed + rank)
    data = ragged_rows(LENGTHS[rank * 4 : (rank + 1) * 4], vocab, gen, first_action=2)
    noise = data.pop("noise")
    return {**data, "old_log_probs": -3.0 + 2 * noise, "old_values": 2 * noise}


def _tensors(obj, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor in a nested state dict, by its path (numbers as 0-d tensors, so they are compared too)."""
    if isinstance(obj, torch.Tensor):
        return {prefix: obj.detach().clone()}
    if isinstance(obj, (int, float)) and not isinstance(obj, bool):
        return {prefix: torch.tensor(obj, dtype=torch.float64)}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else []
    out = {}
    for key, value in items:
        out.update(_tensors(value, f"{prefix}/{key}"))
    return out


def _snapshot(strategy, engine) -> dict[str, dict[str, torch.Tensor]]:
    return {
        "weights": full_weights(strategy, engine),
        "optimizer": _tensors(engine.optimizer.state_dict()),
        "scheduler": _tensors(engine.lr_scheduler.state_dict()),
        "steps": {"global_steps": torch.tensor(engine.global_steps), "lr": torch.tensor(engine.get_lr()[0])},
    }


def _differences(a: dict, b: dict) -> dict[str, list[str]]:
    """Per part of a snapshot: the names whose tensors are missing on one side or not bitwise equal."""
    out = {}
    for part in a:
        names = set(a[part]) | set(b[part])
        out[part] = sorted(
            n
            for n in names
            if n not in a[part]
            or n not in b[part]
            or a[part][n].shape != b[part][n].shape
            or not torch.equal(a[part][n], b[part][n])
        )
    return out


def _worker(rank: int, out_dir: str, port: int) -> None:
    join_gloo_group(rank, port, WORLD)
    from openppo.ppo.batching import Batching
    from openppo.ppo.config import AlgoConfig
    from openppo.ppo.fit import actor_loss, critic_loss, fit_experience
    from tests.model_cache import tiny_model_dir

    path = str(tiny_model_dir())
    results: dict[str, dict] = {}
    for zero in (2, 3):
        strategy = fp32_strategy(zero)
        for role in ROLES:

            def build():
                model = load_model(role, path, strategy, **(dict(lora_rank=4, lora_alpha=8) if role == "lora" else {}))
                return strategy.prepare_train(
                    model,
                    lr=1e-3,
                    betas=(0.9, 0.95),
                    weight_decay=0.01,
                    scheduler="cosine_with_min_lr",
                    warmup_ratio=0.5,
                    min_lr_ratio=0.1,
                    num_training_steps=8,
                )

            def train(engine, seed: int) -> None:
                data = _batch(engine.module.config.vocab_size, rank, seed)
                loss_fn = (
                    critic_loss(engine, AlgoConfig(value_clip=0.5))
                    if role == "critic"
                    else actor_loss(
                        engine,
                        AlgoConfig(advantage_estimator="reinforce", init_kl_coef=0.0),
                        kl_coef=0.0,
                        temperature=1.0,
                        generate_max_len=16,
                        is_correction=None,
                        is_threshold=(0.5, 5.0),
                    )
                )
                fit_experience(
                    engine,
                    data,
                    loss_fn,
                    batching=Batching(rows=2),
                    rows_per_step=2,
                    epochs=1,
                    world_size=WORLD,
                    seed=seed,
                    device=strategy.device,
                )

            saved = build()
            train(saved, seed=1)  # two optimizer steps (rows_per_step 2 of 4 rows)
            before = _snapshot(strategy, saved)
            ckpt_dir = str(Path(out_dir) / f"zero{zero}-{role}")
            strategy.save_checkpoint(saved, ckpt_dir, 2, {"global_step": 2})
            resumed = build()
            fresh = _snapshot(strategy, resumed)
            strategy.load_checkpoint(resumed, ckpt_dir, 2)
            after = _snapshot(strategy, resumed)
            train(saved, seed=2)
            train(resumed, seed=2)
            continued = _differences(_snapshot(strategy, saved), _snapshot(strategy, resumed))
            results[f"zero{zero}/{role}"] = {
                "restored": _differences(before, after),
                "continued": continued["weights"],
                "fresh_differs": {part: len(names) for part, names in _differences(before, fresh).items()},
                "sizes": {part: len(tensors) for part, tensors in before.items()},
                "steps": int(before["steps"]["global_steps"]),
            }
            del saved, resumed
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def resumed(tmp_path_factory) -> list[dict]:
    return run_ranks(_worker, WORLD, tmp_path_factory.mktemp("resume"), TIMEOUT_S, "resume-state")


CASES = [(zero, role) for zero in (2, 3) for role in ROLES]


@pytest.mark.parametrize("zero,role", CASES, ids=[f"zero{z}-{r}" for z, r in CASES])
def test_loaded_state_is_bitwise_the_saved_one(resumed, zero, role):
    for r in resumed:
        case = r[f"zero{zero}/{role}"]
        assert case["steps"] == 2
        assert all(case["sizes"][part] > 0 for part in ("weights", "optimizer", "scheduler")), case["sizes"]
        # the fresh engine really differed (the comparison can fail), then the checkpoint made it equal
        assert case["fresh_differs"]["weights"] > 0 and case["fresh_differs"]["optimizer"] > 0, case
        assert case["fresh_differs"]["steps"] > 0, case
        assert case["restored"] == {part: [] for part in case["restored"]}, case["restored"]
        assert case["continued"] == [], case["continued"][:5]
