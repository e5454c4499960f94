"""Benchmark: padded vs packed (vs packed + token budget) forward and training step on a ragged RL batch, on CPU.

    .venv/bin/python bench/packing.py --model tiny      # the tests' tiny random model (Qwen3 tokenizer, 151k vocab)
    .venv/bin/python bench/packing.py --model smollm2   # SmolLM2-135M-Instruct

The batch looks like a rollout batch: prompts of 16-48 tokens, right-padded to the longest row, and responses of
1 to --max_response tokens, either uniform (`--lengths uniform`) or long-tailed as RL responses usually are
(`--lengths longtail`: log-normal with a median of --max_response / 6, those longer cut at --max_response as the
engine would truncate them). Each variant runs the trainer's own code on a real DeepSpeed engine (1 rank,
ZeRO-0, --dtype auto): the forward-only pass is the old-log-prob pass (`ForwardChunks`), the training step is
the actor update (`fit_experience` with the PPO loss). Baseline: padded micro-batches of --micro rows, each trimmed
to its longest row (what runs without --packing_samples). Best of --repeats after one warm-up; the variants are
timed interleaved, in the same process. The last line printed is one JSON object with the times, the speed-ups and the
device it ran on (CPU model and PyTorch's CPU capability, or the GPU name; `bench/record.py`).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.record import add_dtype_option, emit, resolve_dtype, timing_engine  # noqa: E402 (after the path set-up)

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def response_lengths(rng: random.Random, num_rows: int, max_response: int, shape: str) -> list[int]:
    if shape == "uniform":
        return [rng.randint(1, max_response) for _ in range(num_rows)]
    median = math.log(max_response / 6)
    return [max(1, min(max_response, int(rng.lognormvariate(median, 1.0)))) for _ in range(num_rows)]


def ragged_batch(num_rows: int, max_response: int, vocab: int, seed: int, shape: str = "uniform"):
    import torch

    rng = random.Random(seed)
    prompts = [rng.randint(16, 48) for _ in range(num_rows)]
    responses = response_lengths(rng, num_rows, max_response, shape)
    width = max(p + r for p, r in zip(prompts, responses))
    gen = torch.Generator().manual_seed(seed)
    seqs = torch.randint(100, vocab, (num_rows, width), generator=gen)
    attn = torch.zeros_like(seqs)
    mask = torch.zeros(num_rows, width - 1, dtype=torch.long)
    for row, (p, r) in enumerate(zip(prompts, responses)):
        attn[row, : p + r] = 1
        mask[row, p - 1 : p - 1 + r] = 1
    seqs[attn == 0] = 0
    return {
        "sequences": seqs,
        "attention_mask": attn,
        "action_mask": mask,
        "advantages": torch.randn(num_rows, width - 1, generator=gen) * mask,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    add_dtype_option(parser)
    parser.add_argument("--rows", type=int, default=16, help="samples in the batch")
    parser.add_argument("--micro", type=int, default=4, help="rows per padded micro-batch")
    parser.add_argument("--max_response", type=int, default=192)
    parser.add_argument(
        "--lengths", choices=("uniform", "longtail"), default="uniform", help="distribution of the response lengths"
    )
    parser.add_argument(
        "--max_tokens",
        type=int,
        default=None,
        help="token budget of the dynamic variant (default: micro x mean row length)",
    )
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    args.dtype = resolve_dtype(args.dtype)

    import torch

    from openppo.models.actor import Actor
    from openppo.models.row_layout import RowLayout
    from openppo.ppo.batching import Batching, ForwardChunks
    from openppo.ppo.config import AlgoConfig
    from openppo.ppo.fit import actor_loss, fit_experience
    from openppo.strategy.config import DeepSpeedConfig
    from openppo.strategy.deepspeed_strategy import DeepSpeedStrategy
    from tests.model_cache import smollm2_dir, tiny_model_dir

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = str(tiny_model_dir() if args.model == "tiny" else smollm2_dir())
    strategy = DeepSpeedStrategy(
        DeepSpeedConfig(zero_stage=0, param_dtype=args.dtype, dist_timeout=600),
        train_batch_size=args.rows,
        micro_batch_size=args.micro,
        max_norm=1.0,
        seed=0,
    )
    strategy.setup_distributed()
    model = Actor.from_pretrained(model_dir, dtype=strategy.torch_dtype)
    engine = timing_engine(strategy, model)
    vocab = model.config.vocab_size
    data = ragged_batch(args.rows, args.max_response, vocab, seed=0, shape=args.lengths)
    lengths = data["attention_mask"].sum(-1)
    budget = args.max_tokens or int(args.micro * lengths.float().mean())
    variants = {
        "padded": Batching(rows=args.micro),
        "packed": Batching(packed=True, rows=args.micro),
        "packed_dynamic": Batching(packed=True, rows=args.micro, max_tokens=budget),
    }

    @torch.no_grad()
    def forward(b: Batching) -> torch.Tensor:
        engine.module.layout = RowLayout(packed=b.packed)
        chunks = ForwardChunks(engine, strategy, data, b)
        for m in chunks:
            chunks.add(engine(m["sequences"], m["attention_mask"], score_mask=m["action_mask"]).log_probs)
        return chunks.result()

    with torch.no_grad():
        data["old_log_probs"] = forward(variants["padded"])
    algo = AlgoConfig(advantage_estimator="group_norm", init_kl_coef=0.0)

    def train(b: Batching) -> dict:
        loss_fn = actor_loss(
            engine,
            algo,
            kl_coef=0.0,
            temperature=1.0,
            generate_max_len=args.max_response,
            is_correction=None,
            is_threshold=(0.5, 5.0),
        )
        engine.module.layout = RowLayout(packed=b.packed)
        return fit_experience(
            engine,
            data,
            loss_fn,
            batching=b,
            rows_per_step=args.rows,
            epochs=1,
            world_size=1,
            seed=0,
            device=strategy.device,
        )

    times: dict[str, dict[str, list[float]]] = {name: {"forward": [], "train": []} for name in variants}
    results: dict[str, dict] = {}
    max_diff = 0.0
    reference = data["old_log_probs"]
    valid = data["action_mask"].bool()
    for repeat in range(args.repeats + 1):  # round 0 is the warm-up
        for name, b in variants.items():
            t0 = time.perf_counter()
            lp = forward(b)
            t1 = time.perf_counter()
            metrics = train(b)
            t2 = time.perf_counter()
            if repeat:
                times[name]["forward"].append(t1 - t0)
                times[name]["train"].append(t2 - t1)
            results[name] = {
                "padding_share": metrics["perf/padding_share"],
                "micro_batches": metrics["perf/micro_batches"],
            }
            if repeat == 0:  # same weights for every variant's forward (lr 1e-7 barely moves them later)
                max_diff = max(max_diff, (lp - reference)[valid].abs().max().item())
            print(f"round {repeat} {name}: forward {t1 - t0:.2f} s, train step {t2 - t1:.2f} s", flush=True)
    best = {name: {k: min(v) for k, v in t.items()} for name, t in times.items()}
    out = {
        "bench": "packing",
        "model": args.model,
        "vocab": vocab,
        "rows": args.rows,
        "micro": args.micro,
        "lengths": args.lengths,
        "mean_row_tokens": round(lengths.float().mean().item(), 1),
        "max_row_tokens": int(lengths.max()),
        # the speed-up if padding cost nothing and all work were proportional to tokens
        "ceiling": round(1 / (1 - results["padded"]["padding_share"]), 2),
        "token_budget": budget,
        "threads": torch.get_num_threads(),
        "max_logprob_diff": max_diff,
        "dtype": args.dtype,
    }
    for name in variants:
        out[name] = {
            "forward_s": round(best[name]["forward"], 3),
            "train_s": round(best[name]["train"], 3),
            **results[name],
        }
        if name != "padded":
            out[name]["forward_speedup"] = round(best["padded"]["forward"] / best[name]["forward"], 2)
            out[name]["train_speedup"] = round(best["padded"]["train"] / best[name]["train"], 2)
    emit(out)


if __name__ == "__main__":
    main()
