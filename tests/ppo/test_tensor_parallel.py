"""--ds_tensor_parallel_size: DeepSpeed AutoTP on 2 gloo ranks (CPU) against plain single-process autograd.

One spawn of two workers (a module fixture) holding one tensor-parallel group (data-parallel size 1). Each rank
builds the tiny model twice: as a real DeepSpeed AutoTP engine (ZeRO-0, fp32) and as a plain `Actor`. It checks
the weight gather the sync and the HF export use, the log-probs (of packed and of shared-prompt rows), and two
optimizer steps of `fit_experience`, on packed rows and then on shared-prompt rows (the loss and the gradient at the
boundary: each rank's weight slice against the same slice of the gradient plain autograd gives the step loss
written from the formulas, which catches a wrong backward scale or a normaliser counted once per replica), then
writes the measured errors to a JSON file that the tests read.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.ppo.rank_helpers import (
    GradAtBoundary,
    grouped_rows,
    join_gloo_group,
    ppo_per_token,
    reduce_global,
    train_engine,
)
from tests.ppo.test_dynamic_batch import _experience
from tests.spawn import run_ranks

WORLD = 2
TIMEOUT_S = 300
EPS = 0.2


def _slice_like(full: torch.Tensor, shard: torch.Tensor, rank: int) -> torch.Tensor:
    """This rank's slice of a full tensor: AutoTP splits a weight along one dim into equal parts here."""
    for dim in range(full.dim()):
        if full.shape[dim] != shard.shape[dim]:
            k = shard.shape[dim]
            return full.narrow(dim, rank * k, k)
    return full


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _worker(rank: int, out_dir: str, port: int) -> None:
    join_gloo_group(rank, port, WORLD)
    from openppo.models.actor import Actor
    from openppo.models.hf import load_tokenizer
    from openppo.models.row_layout import RowLayout
    from openppo.ppo.batching import Batching
    from openppo.ppo.config import AlgoConfig
    from openppo.ppo.fit import actor_loss, fit_experience
    from openppo.rollout.sender import iter_full_weights
    from openppo.strategy.config import DeepSpeedConfig
    from openppo.strategy.deepspeed_strategy import DeepSpeedStrategy
    from tests.model_cache import tiny_model_dir

    path = str(tiny_model_dir())
    strategy = DeepSpeedStrategy(
        DeepSpeedConfig(zero_stage=0, param_dtype="fp32", dist_timeout=120),
        train_batch_size=8 * WORLD,
        micro_batch_size=2,
        max_norm=0.0,
        seed=0,
        tensor_parallel_size=WORLD,
    )
    strategy.setup_distributed()
    plain = Actor.from_pretrained(path, dtype=torch.float32)
    engine = GradAtBoundary(train_engine(strategy, Actor.from_pretrained(path, dtype=torch.float32), lr=1e-3, steps=4))
    results: dict[str, float] = {}
    shards = {n: p for n, p in engine.module.named_parameters()}
    results["split_weights"] = float(
        sum(p.numel() for p in shards.values()) < sum(p.numel() for p in plain.parameters())
    )

    # The gather of the weight sync: full HF-named weights on rank 0, equal to the unsplit model's.
    full = dict(iter_full_weights(engine.module, rank=rank))
    if rank == 0:
        reference = dict(plain.model.named_parameters())
        results["sync_names_match"] = float(set(full) == set(reference))
        results["sync_weights"] = max((full[n] - reference[n]).abs().max().item() for n in reference)
    else:
        results["sync_names_match"] = float(full == {})
        results["sync_weights"] = 0.0

    data = _experience()
    with torch.no_grad():
        engine.module.layout = RowLayout(packed=True)
        ours = engine(data["sequences"], data["attention_mask"]).log_probs
        theirs = plain(data["sequences"], data["attention_mask"]).log_probs
    mask = data["attention_mask"][:, 1:].bool()
    results["log_probs"] = (ours - theirs)[mask].abs().max().item()
    # shared-prompt rows (--share_prompt_in_group) on the split heads: the unsplit model's packed log-probs
    groups = grouped_rows([(9, [4, 7, 2]), (5, [6, 3])])
    scored = groups["action_mask"].bool()
    with torch.no_grad():
        engine.module.layout = RowLayout(packed=True, share_prompts=True)
        shared = engine(groups["sequences"], groups["attention_mask"], score_mask=groups["action_mask"]).log_probs
        engine.module.layout = RowLayout(packed=True)
        unshared = plain(groups["sequences"], groups["attention_mask"]).log_probs
    results["shared_log_probs"] = (shared - unshared)[scored].abs().max().item()
    data["old_log_probs"] = theirs + 0.05 * torch.randn(theirs.shape, generator=torch.Generator().manual_seed(1))

    # The reference: plain autograd of the step's token-mean PPO loss over all rows, written from the formulas. The
    # two ranks hold the same rows: the step's token count, all-reduced over both, must be divided by the replicas.
    per_token = ppo_per_token(
        plain(data["sequences"], data["attention_mask"]).log_probs, data["old_log_probs"], data["advantages"], EPS
    )
    reference_loss = reduce_global(per_token, data["action_mask"], "token-mean", 32)
    reference_loss.backward()
    algo = AlgoConfig(advantage_estimator="reinforce", init_kl_coef=0.0, eps_clip=EPS, loss_agg_mode="token-mean")
    loss_fn = actor_loss(
        engine,
        algo,
        kl_coef=0.0,
        temperature=1.0,
        generate_max_len=32,
        is_correction=None,
        is_threshold=(0.5, 5.0),
    )
    metrics = fit_experience(
        engine,
        data,
        loss_fn,
        batching=Batching(packed=True, rows=2, max_tokens=40),
        rows_per_step=8,
        epochs=1,
        world_size=WORLD,
        seed=0,
        device=strategy.device,
        tensor_parallel_size=WORLD,
    )
    results["loss"] = abs(metrics["train/policy_loss"] - reference_loss.item())
    grads, reference = engine.grads[0], dict(plain.named_parameters())
    results["grads_rel"] = max(_rel(g, _slice_like(reference[n].grad, g, rank)) for n, g in grads.items())

    # HF export after the step: the gathered weights, loadable by transformers.
    out = Path(out_dir) / "hf"
    strategy.save_hf(engine.engine, load_tokenizer(path), out)
    trained = dict(iter_full_weights(engine.module, rank=rank))
    if rank == 0:
        from transformers import AutoModelForCausalLM

        exported = dict(AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).named_parameters())
        results["export"] = max((exported[n] - t).abs().max().item() for n, t in trained.items())
        results["trained_moved"] = max((trained[n] - full[n]).abs().max().item() for n in trained)

    # A second step, on shared-prompt rows (--share_prompt_in_group: a group's prompt once, on the split heads),
    # against plain autograd of the same rows unshared, through the model the export wrote: the engine's weights now.
    torch.distributed.barrier()
    after = Actor.from_pretrained(str(out), dtype=torch.float32)
    gen = torch.Generator().manual_seed(2)
    groups["advantages"] = torch.randn(groups["action_mask"].shape, generator=gen) * groups["action_mask"]
    with torch.no_grad():
        base = after(groups["sequences"], groups["attention_mask"]).log_probs
    groups["old_log_probs"] = base + 0.05 * torch.randn(base.shape, generator=gen)
    per_token = ppo_per_token(
        after(groups["sequences"], groups["attention_mask"]).log_probs,
        groups["old_log_probs"],
        groups["advantages"],
        EPS,
    )
    reference_loss = reduce_global(per_token, groups["action_mask"], "token-mean", 32)
    reference_loss.backward()
    engine.module.layout = RowLayout(packed=True, share_prompts=True)
    rows = groups["sequences"].shape[0]
    metrics = fit_experience(
        engine,
        groups,
        loss_fn,
        batching=Batching(packed=True, rows=rows, share_prompts=True),
        rows_per_step=rows,
        epochs=1,
        world_size=WORLD,
        seed=0,
        device=strategy.device,
        tensor_parallel_size=WORLD,
    )
    results["shared_share"] = metrics.get("perf/shared_prompt_share", 0.0)
    results["shared_loss"] = abs(metrics["train/policy_loss"] - reference_loss.item())
    reference = dict(after.named_parameters())
    results["shared_grads_rel"] = max(
        _rel(g, _slice_like(reference[n].grad, g, rank)) for n, g in engine.grads[1].items()
    )
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory) -> list[dict]:
    return run_ranks(_worker, WORLD, tmp_path_factory.mktemp("tp"), TIMEOUT_S, "tensor-parallel")


def test_weights_are_split_and_the_sync_gathers_them_whole(tp_results):
    for r in tp_results:
        assert r["split_weights"] == 1.0 and r["sync_names_match"] == 1.0
        assert r["sync_weights"] == 0.0


def test_log_probs_equal_the_unsplit_model(tp_results):
    for r in tp_results:
        assert r["log_probs"] <= 1e-5, r


def test_shared_prompt_log_probs_equal_the_unsplit_model(tp_results):
    for r in tp_results:
        assert r["shared_log_probs"] <= 1e-5, r


def test_one_step_has_the_unsplit_loss_and_gradient(tp_results):
    for r in tp_results:
        assert r["loss"] <= 1e-6, r
        assert r["grads_rel"] <= 1e-5, r  # a backward scaled by the world size instead would be off by 1.0


def test_shared_prompt_step_has_the_unsplit_loss_and_gradient(tp_results):
    for r in tp_results:
        assert r["shared_share"] > 0, r  # the prompts were computed once
        assert r["shared_loss"] <= 1e-6, r
        assert r["shared_grads_rel"] <= 1e-5, r


def test_hf_export_holds_the_trained_weights(tp_results):
    r = tp_results[0]
    assert r["export"] <= 1e-6, r
    assert r["trained_moved"] > 0, r  # the step changed the weights the export and the sync see
