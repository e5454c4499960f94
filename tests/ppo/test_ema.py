"""--enable_ema: the actor's weight average against the recurrence computed from the full weights of every step.

Two spawned gloo ranks, fp32, ZeRO-0 and ZeRO-3 (where the average's updates gather the partitions). After each
optimizer step every rank records the full weights; rank 0 then computes e_k = beta e_(k-1) + (1 - beta) w_k from
them, starting at the initial weights, in one process, and compares it with what an HF export of the average holds
(`save_hf_folder` of `WeightAverage.state`, as `ActorWorker.save_hf` writes it).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.ppo.rank_helpers import fp32_strategy, full_weights, join_gloo_group, load_model, ragged_rows, train_engine
from tests.spawn import run_ranks

WORLD = 2
BETA = 0.6
LENGTHS = [5, 17, 9, 30, 12, 3, 22, 8, 11, 6, 14, 9, 20, 7, 4, 16]  # 8 rows a rank: 2 optimizer steps of 4 rows


def _train_and_export(rank: int, zero: int, out: Path) -> dict | None:
    """Four optimizer steps on this rank's 8 rows with the average updated after each; rank 0 exports it and
    returns how far the export is from the recurrence over the recorded weights."""
    from safetensors.torch import load_file

    from openppo.models.hf import load_tokenizer, save_hf_folder
    from openppo.ppo.batching import Batching
    from openppo.ppo.config import AlgoConfig
    from openppo.ppo.fit import WeightAverage, actor_loss, fit_experience
    from tests.model_cache import tiny_model_dir

    path = str(tiny_model_dir())
    strategy = fp32_strategy(zero, max_norm=0.0)
    engine = train_engine(strategy, load_model("actor", path, strategy), lr=5e-3, steps=8)
    ema = WeightAverage(engine.module, BETA, rank)
    seen = [full_weights(strategy, engine)]
    data = ragged_rows(LENGTHS, 1000, torch.Generator().manual_seed(0))
    mine = {k: v[rank * 8 : (rank + 1) * 8] for k, v in data.items() if k != "noise"}
    with torch.no_grad():
        mine["old_log_probs"] = engine(mine["sequences"], mine["attention_mask"]).log_probs

    def after_step():
        ema.update()
        seen.append(full_weights(strategy, engine))  # a collective under ZeRO-3: every rank is here

    algo = AlgoConfig(advantage_estimator="reinforce", init_kl_coef=0.0)
    loss_fn = actor_loss(
        engine, algo, kl_coef=0.0, temperature=1.0, generate_max_len=32, is_correction=None, is_threshold=(0.5, 5)
    )
    for epoch in range(2):
        fit_experience(
            engine,
            mine,
            loss_fn,
            batching=Batching(rows=2),
            rows_per_step=4,
            epochs=1,
            world_size=WORLD,
            seed=epoch,
            device=strategy.device,
            after_step=after_step,
        )
    if rank != 0:
        return None
    save_hf_folder(engine.module.model, ema.state(torch.float32), load_tokenizer(path), out)
    expected = {n: t.clone() for n, t in seen[0].items()}
    for weights in seen[1:]:
        for n, t in weights.items():
            expected[n] = BETA * expected[n] + (1 - BETA) * t
    exported = load_file(out / "model.safetensors")
    assert set(exported) == set(load_file(Path(path) / "model.safetensors"))  # the checkpoint's own names
    return {
        "steps": len(seen) - 1,
        "moved": max((seen[-1][n] - seen[0][n]).abs().max().item() for n in seen[0]),
        "average_error": max((exported[n.removeprefix("model.")] - t).abs().max().item() for n, t in expected.items()),
    }


def _worker(rank: int, out_dir: str, port: int) -> None:
    join_gloo_group(rank, port, WORLD)
    results = {f"zero{zero}": _train_and_export(rank, zero, Path(out_dir) / f"zero{zero}") for zero in (0, 3)}
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def ema_results(tmp_path_factory):
    return run_ranks(_worker, WORLD, tmp_path_factory.mktemp("ema"), 600, "EMA")[0]


@pytest.mark.parametrize("zero", [0, 3])
def test_export_holds_the_average_of_every_step(ema_results, zero):
    r = ema_results[f"zero{zero}"]
    assert r["steps"] == 4  # 2 epochs x 2 optimizer steps
    assert r["moved"] > 1e-3  # the weights did move, so the average differs from them and from the start
    assert r["average_error"] < 1e-6, r


def test_mixture_of_experts_average_exports_under_the_checkpoint_names(tmp_path):
    """A mixture-of-experts model's average (one process, no DeepSpeed): every expert's weights are averaged and the
    export names them as the checkpoint does (transformers keeps the experts fused in memory)."""
    from safetensors.torch import load_file

    from openppo.models.actor import Actor
    from openppo.models.hf import load_tokenizer, save_hf_folder
    from openppo.ppo.fit import WeightAverage
    from tests.model_cache import tiny_model_dir

    path = tiny_model_dir(arch="qwen3_moe")
    actor = Actor.from_pretrained(str(path), dtype=torch.float32)
    ema = WeightAverage(actor, BETA, rank=0)
    with torch.no_grad():
        for p in actor.parameters():
            p.add_(1.0)
    ema.update()
    save_hf_folder(actor.model, ema.state(torch.float32), load_tokenizer(str(path)), tmp_path)
    exported, initial = load_file(tmp_path / "model.safetensors"), load_file(path / "model.safetensors")
    assert set(exported) == set(initial)
    assert any(".experts." in name for name in initial)
    for name, w in initial.items():  # e = beta w0 + (1 - beta) (w0 + 1)
        torch.testing.assert_close(exported[name], w + (1 - BETA), rtol=0, atol=1e-6, msg=name)
