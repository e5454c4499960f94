"""Every trainable parameter learns: one optimizer step with a non-zero loss changes each of them.

A frozen parameter is a silent failure (a peer's ZeRO-3 run once left most decoder weights untouched without a
word). Two spawned gloo ranks (one module fixture), fp32, under ZeRO-2 and ZeRO-3: the actor (policy loss) of each
tiny architecture of the zoo (Llama, Qwen2, Qwen3, Mistral shapes), and on Qwen2 and Qwen3 the critic (value loss)
and a LoRA actor too. The full weights are gathered before and after `fit_experience` and compared tensor by
tensor.

LoRA runs two optimizer steps: PEFT starts B at zero, so the first step's gradient of A (which is multiplied by B)
is exactly zero and only B moves; from the second step on both do. The base weights must not move at all.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.ppo.rank_helpers import fp32_strategy, full_weights, join_gloo_group, load_model, ragged_rows, train_engine
from tests.spawn import run_ranks

WORLD = 2
TIMEOUT_S = 600
ARCHS = ("llama", "qwen2", "qwen3", "mistral")
ROLES = ("actor", "critic", "lora")
FULL_ARCHS = ("qwen2", "qwen3")  # every role; the others train the actor only
LENGTHS = [9, 14, 6, 11, 12, 7, 10, 13]  # 4 rows per rank


def _batch(vocab: int, rank: int) -> dict[str, torch.Tensor]:
    return ragged_rows(LENGTHS[rank * 4 : (rank + 1) * 4], vocab, torch.Generator().manual_seed(rank), first_action=2)


def _roles(arch: str) -> tuple[str, ...]:
    return ROLES if arch in FULL_ARCHS else ("actor",)


def _model_dir(tiny_model_dir, arch: str):
    """The zoo's tiny model of `arch` (Qwen3 tokenizer, hidden 64, 2 layers)."""
    return tiny_model_dir() if arch == "qwen2" else tiny_model_dir(arch=arch)


def _worker(rank: int, out_dir: str, port: int) -> None:
    join_gloo_group(rank, port, WORLD)
    from openppo.ppo.batching import Batching
    from openppo.ppo.config import AlgoConfig
    from openppo.ppo.fit import actor_loss, critic_loss, fit_experience
    from tests.model_cache import tiny_model_dir

    results: dict[str, dict] = {}
    for arch in ARCHS:
        path = str(_model_dir(tiny_model_dir, arch))
        for zero in (2, 3):
            strategy = fp32_strategy(zero)
            for role in _roles(arch):
                model = load_model(role, path, strategy, **(dict(lora_rank=4, lora_alpha=8) if role == "lora" else {}))
                trainable = {n for n, p in model.named_parameters() if p.requires_grad}
                engine = train_engine(strategy, model, lr=1e-3, steps=8)
                data = _batch(model.config.vocab_size, rank)
                with torch.no_grad():
                    if role == "critic":
                        data["old_values"] = engine(data["sequences"], data["attention_mask"])[:, :-1]
                    else:
                        data["old_log_probs"] = engine(data["sequences"], data["attention_mask"]).log_probs
                        data["old_log_probs"] += data["noise"]
                del data["noise"]
                if role == "critic":
                    loss_fn = critic_loss(engine, AlgoConfig(value_clip=0.5))
                else:
                    loss_fn = actor_loss(
                        engine,
                        AlgoConfig(advantage_estimator="reinforce", init_kl_coef=0.0),
                        kl_coef=0.0,
                        temperature=1.0,
                        generate_max_len=16,
                        is_correction=None,
                        is_threshold=(0.5, 5.0),
                    )
                before = full_weights(strategy, engine)
                metrics = fit_experience(
                    engine,
                    data,
                    loss_fn,
                    batching=Batching(rows=2),
                    rows_per_step=2 if role == "lora" else 4,
                    epochs=1,
                    world_size=WORLD,
                    seed=0,
                    device=strategy.device,
                )
                after = full_weights(strategy, engine)
                moved = {n for n in before if not torch.equal(before[n], after[n])}
                results[f"{arch}/zero{zero}/{role}"] = {
                    "loss": metrics["train/value_loss" if role == "critic" else "train/policy_loss"],
                    "trainable": sorted(trainable),
                    "moved": sorted(moved),
                    "frozen_moved": sorted(moved - trainable),
                    "num_params": len(before),
                }
                del engine, model
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def learned(tmp_path_factory) -> list[dict]:
    from tests.model_cache import tiny_model_dir

    for arch in ARCHS:  # built (or found) once here, not by both ranks at once
        _model_dir(tiny_model_dir, arch)
    return run_ranks(_worker, WORLD, tmp_path_factory.mktemp("learn"), TIMEOUT_S, "every-parameter-learns")


CASES = [(arch, zero, role) for arch in ARCHS for zero in (2, 3) for role in _roles(arch)]


@pytest.mark.parametrize("arch,zero,role", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_every_trainable_parameter_moves_and_no_frozen_one_does(learned, arch, zero, role):
    for r in learned:
        case = r[f"{arch}/zero{zero}/{role}"]
        assert case["loss"] != 0.0, case["loss"]
        still = sorted(set(case["trainable"]) - set(case["moved"]))
        assert not still, f"{len(still)} of {len(case['trainable'])} trainable parameters did not change: {still[:5]}"
        assert not case["frozen_moved"], case["frozen_moved"][:5]
        if role == "lora":  # adapters only: the base model is frozen, and it is most of the parameters
            assert all("lora_" in n for n in case["trainable"]) and len(case["trainable"]) < case["num_params"]
        else:
            assert len(case["trainable"]) == case["num_params"]
