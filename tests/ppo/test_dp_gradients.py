"""The gradient DeepSpeed applies on 2 data-parallel ranks is the gradient of the global loss.

Two spawned gloo ranks (one module fixture), fp32, max_norm 0. The step's 8 rows are split 4 + 4, and the ranks'
rows hold different numbers of tokens (61 against 46, one response fully masked), so any per-rank or
per-micro-batch normaliser shows. Rows 0-5 come in pairs that share a 3-token prompt, as a GRPO group. For ZeRO-2
and ZeRO-3, each micro-batch layout (padded rows, packed rows, token-budget micro-batches of a different count on
each rank, shared-prompt rows with each pair's prompt computed once) and each `--loss_agg_mode`, plus the critic's
value loss, `fit_experience` runs one optimizer step and the fully reduced gradient of every parameter is read at the
accumulation boundary (`deepspeed.utils.safe_get_full_grad`, before the optimizer uses it).

The same comparison runs for a ring (`--ring_attn_size 2`, ZeRO-2): both ranks form one ring and hold all 8 rows,
each computes half of every packed row, and the normalisers, counted on both ranks, must be divided by the ring
(the replicas) once. AutoTP, whose ranks also replicate rows, has its own check in test_tensor_parallel.py.

The LM head in chunks (--lm_head_chunk_tokens 3, chunks that cut across rows) takes the same comparison under
ZeRO-3, whose partitioned head each chunk gathers, and in the ring, for the actor's token-mean loss.

The reference is independent of the code under test: one process, one padded forward of all 8 rows through a plain
copy of the same weights, the per-token loss and its global reduction written out below from the papers' formulas,
and `torch.autograd`. The learning rate is 0, so the engine's weights stay those of the reference throughout.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.ppo.rank_helpers import (
    GradAtBoundary,
    fp32_strategy,
    full_grads,
    full_weights,
    join_gloo_group,
    load_model,
    ppo_per_token,
    ragged_rows,
    reduce_global,
    train_engine,
    value_per_token,
)
from tests.spawn import run_ranks

WORLD = 2
TIMEOUT_S = 600
LENGTHS = [5, 17, 9, 30, 12, 4, 22, 8]  # rows 0-3 on rank 0 (61 tokens), rows 4-7 on rank 1 (46 tokens)
PROMPT = 3  # tokens before each row's first action; rows 2k and 2k + 1 (k < 3) share theirs
EMPTY_ROW = 6  # a response with no kept token: no sample of the step in any mode
EPS = 0.2
VALUE_CLIP = 0.2
NORM_LEN = 32
MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
LAYOUTS = {
    "padded": dict(rows=2),
    "packed": dict(packed=True, rows=2),
    "token_budget": dict(packed=True, rows=4, max_tokens=40),
    "shared": dict(packed=True, rows=2, share_prompts=True),
}
# (ZeRO stage, ring size, LM head chunk): data-parallel ZeRO-2 and ZeRO-3, one ring of 2; the chunked head
CONFIGS = [(2, 1, 0), (3, 1, 0), (2, 2, 0), (3, 1, 3), (2, 2, 3)]


def _config_name(zero: int, ring: int, chunk: int = 0) -> str:
    return (f"zero{zero}" if ring == 1 else f"ring{ring}-zero{zero}") + (f"-head{chunk}" if chunk else "")


def _roles_and_modes(chunk: int) -> list[tuple[str, tuple[str, ...]]]:
    """What a config trains: the chunked head is the actor's, checked with one loss mode."""
    if chunk:
        return [("actor", ("token-mean",))]
    return [("actor", MODES), ("critic", ("token-mean",))]


def _global_batch(vocab: int) -> dict[str, torch.Tensor]:
    data = ragged_rows(
        LENGTHS, vocab, torch.Generator().manual_seed(0), first_action=PROMPT - 1, empty_rows=(EMPTY_ROW,)
    )
    for row in (0, 2, 4):
        data["sequences"][row + 1, :PROMPT] = data["sequences"][row, :PROMPT]
    return data


def _plain_copy(strategy, engine, plain) -> None:
    """Load the engine's full weights into the plain model (the critic's value head starts random)."""
    result = plain.load_state_dict(full_weights(strategy, engine), strict=False)
    assert not result.unexpected_keys and not set(result.missing_keys) & {n for n, _ in plain.named_parameters()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


def _worker(rank: int, out_dir: str, port: int) -> None:
    join_gloo_group(rank, port, WORLD)
    from openppo.models.row_layout import RowLayout, ring_layout
    from openppo.ppo.batching import Batching
    from openppo.ppo.config import AlgoConfig
    from openppo.ppo.fit import actor_loss, critic_loss, fit_experience
    from tests.model_cache import tiny_model_dir

    path = str(tiny_model_dir())
    results: dict[str, float] = {}
    for zero, ring, chunk in CONFIGS:
        strategy = fp32_strategy(zero, max_norm=0.0)
        for role, modes in _roles_and_modes(chunk):
            model = load_model(role, path, strategy)
            if chunk:
                assert model.chunk_head(chunk) is None
            ring_rows = ring_layout(model.model, ring, head_stride=1) if ring > 1 else None
            engine = GradAtBoundary(
                train_engine(strategy, model, lr=0.0, steps=64),
                read=full_grads,
            )
            plain = load_model(role, path)
            _plain_copy(strategy, engine, plain)
            data = _global_batch(plain.config.vocab_size)
            mask = data["action_mask"]
            if role == "actor":
                with torch.no_grad():
                    data["old_log_probs"] = plain(data["sequences"], data["attention_mask"]).log_probs + data["noise"]
            else:
                with torch.no_grad():
                    data["old_values"] = plain(data["sequences"], data["attention_mask"])[:, :-1] + data["noise"]
            # data-parallel: 4 rows a rank; one ring: every rank holds all 8 rows
            rows = slice(rank * 4, (rank + 1) * 4) if ring == 1 else slice(None)
            mine = {k: v[rows] for k, v in data.items() if k != "noise"}
            for mode in modes:
                # the reference: plain autograd over the whole step in one process
                plain.zero_grad()
                if role == "actor":
                    log_probs = plain(data["sequences"], data["attention_mask"]).log_probs
                    per_token = ppo_per_token(log_probs, data["old_log_probs"], data["advantages"], EPS)
                else:
                    values = plain(data["sequences"], data["attention_mask"])[:, :-1]
                    per_token = value_per_token(values, data["old_values"], data["returns"], VALUE_CLIP)
                reference_loss = reduce_global(per_token, mask, mode, NORM_LEN)
                reference_loss.backward()
                # a logged token mean over the whole step: the k3 KL estimate (actor), the values (critic)
                if role == "actor":
                    x = (log_probs.detach() - data["old_log_probs"])[mask.bool()]
                    logged_expected = (x.expm1() - x).mean().item()
                else:
                    logged_expected = values.detach()[mask.bool()].mean().item()
                expected = {n: p.grad for n, p in plain.named_parameters() if p.grad is not None}
                for layout, kwargs in LAYOUTS.items():
                    if ring > 1 and (not kwargs.get("packed") or kwargs.get("share_prompts")):
                        continue  # a ring shards packed rows only, and shares no prompt
                    batching = Batching(**kwargs)
                    model.layout = ring_rows or RowLayout(packed=batching.packed, share_prompts=batching.share_prompts)
                    if role == "actor":
                        algo = AlgoConfig(
                            advantage_estimator="reinforce", init_kl_coef=0.0, eps_clip=EPS, loss_agg_mode=mode
                        )
                        loss_fn = actor_loss(
                            engine,
                            algo,
                            kl_coef=0.0,
                            temperature=1.0,
                            generate_max_len=NORM_LEN,
                            is_correction=None,
                            is_threshold=(0.5, 5.0),
                        )
                    else:
                        loss_fn = critic_loss(engine, AlgoConfig(value_clip=VALUE_CLIP))
                    engine.grads.clear()
                    metrics = fit_experience(
                        engine,
                        mine,
                        loss_fn,
                        batching=batching,
                        rows_per_step=mine["sequences"].size(0),
                        epochs=1,
                        world_size=WORLD,
                        seed=0,
                        device=strategy.device,
                        ring_size=ring,
                    )
                    assert len(engine.grads) == 1, len(engine.grads)
                    got = engine.grads[0]
                    key = f"{_config_name(zero, ring, chunk)}/{role}/{mode}/{layout}"
                    results[key + "/grad"] = max(_rel(got[n], g) for n, g in expected.items())
                    results[key + "/untouched"] = float(all(got[n].abs().max() == 0 for n in got if n not in expected))
                    # the logged step loss: this rank's contributions, times the ranks, then averaged by the caller
                    loss_key = "train/policy_loss" if role == "actor" else "train/value_loss"
                    results[key + "/loss_rank"] = metrics[loss_key]
                    results[key + "/loss_expected"] = reference_loss.item()
                    results[key + "/shared"] = metrics.get("perf/shared_prompt_share", 0.0)
                    results[key + "/logged"] = metrics["train/approx_kl" if role == "actor" else "train/values"]
                    results[key + "/logged_expected"] = logged_expected
            del engine
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def dp_results(tmp_path_factory) -> list[dict]:
    return run_ranks(_worker, WORLD, tmp_path_factory.mktemp("dp"), TIMEOUT_S, "data-parallel gradient")


CASES = [
    (_config_name(zero, ring, chunk), role, mode, layout)
    for zero, ring, chunk in CONFIGS
    for role, modes in _roles_and_modes(chunk)
    for mode in modes
    for layout, kwargs in LAYOUTS.items()
    if ring == 1 or (kwargs.get("packed") and not kwargs.get("share_prompts"))
]


@pytest.mark.parametrize("config,role,mode,layout", CASES, ids=["-".join(c) for c in CASES])
def test_applied_gradient_is_the_global_loss_gradient(dp_results, config, role, mode, layout):
    key = f"{config}/{role}/{mode}/{layout}"
    for r in dp_results:
        # a per-rank normaliser would be off by the ranks' token ratio (61 / 46); a missing rank scale by 2x
        assert r[key + "/grad"] <= 1e-5, (key, r[key + "/grad"])
        assert r[key + "/untouched"] == 1.0, key
    # the shared layout computed a pair's prompt once (where a shuffle keeps a pair in one micro-batch of 2 rows)
    assert (max(r[key + "/shared"] for r in dp_results) > 0) == (layout == "shared"), key
    # the logged loss, averaged over the ranks as the caller does, is the global loss
    mean_loss = sum(r[key + "/loss_rank"] for r in dp_results) / WORLD
    assert mean_loss == pytest.approx(dp_results[0][key + "/loss_expected"], rel=1e-5, abs=1e-7), key
    # a token-mean metric is the step's over every rank's tokens, on each rank (not a mean of the ranks' means,
    # which weighs the ranks' 61 and 46 tokens alike)
    for r in dp_results:
        assert r[key + "/logged"] == pytest.approx(r[key + "/logged_expected"], rel=1e-5, abs=1e-8), key
