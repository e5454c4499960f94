"""Benchmark: the actor update and the old-log-prob forward with and without shared prompts (--share_prompt_in_group).

    .venv/bin/python bench/shared_prompts.py --model smollm2 --job demo          # the demo's shape
    .venv/bin/python bench/shared_prompts.py --model smollm2 --job long_prompt   # 512-token prompts
    python bench/shared_prompts.py --model qwen0.5b --job long_prompt --dtype bf16   # a GPU (tests/gpu/run.sh)

A GRPO batch of --groups prompts with --n responses each: `demo` has 46-token prompts and responses of 10-25
tokens (the demo job's shape), `long_prompt` 512-token prompts and 128-token responses (few-shot math recipes).
On a GPU the shared rows attend through FlexAttention (`openppo.models.varlen_attention`), on CPU through one sdpa
call per micro-batch's responses; `qwen0.5b` is a random model of Qwen2.5-0.5B's shape (`bench/record.py`).
Both variants run the trainer's own code on one rank (real DeepSpeed, ZeRO-0, --dtype auto), with packed rows
under the same token budget per micro-batch (or the same --micro_rows, as the demo's --micro_train_batch_size 8):
`packed` computes every row's prompt, `shared` each group's prompt once. The update is `fit_experience` with the
PPO loss; the forward is the old-log-prob pass (`ForwardChunks`). Best of --repeats after one warm-up, the
variants interleaved in one process. The last line printed is one JSON object with the times, their ratios, the
tokens each variant computes and the device.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.record import MODELS, add_dtype_option, emit, model_path, resolve_dtype, timing_engine  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")

JOBS = {"demo": (46, (10, 25)), "long_prompt": (512, (128, 128))}  # prompt tokens, (min, max) response tokens


def group_batch(groups: int, n: int, prompt_len: int, response: tuple[int, int], vocab: int, seed: int):
    """`groups` prompts of `prompt_len` tokens, each followed by `n` responses: right-padded rows, a group's rows
    consecutive, the action mask over each response."""
    import torch

    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    rows, spans = [], []
    for _ in range(groups):
        prompt = torch.randint(100, vocab, (prompt_len,), generator=gen)
        for _ in range(n):
            r = rng.randint(*response)
            rows.append(torch.cat([prompt, torch.randint(100, vocab, (r,), generator=gen)]))
            spans.append(r)
    width = max(row.numel() for row in rows)
    seqs = torch.zeros(len(rows), width, dtype=torch.long)
    attn = torch.zeros_like(seqs)
    mask = torch.zeros(len(rows), width - 1, dtype=torch.long)
    for i, (row, r) in enumerate(zip(rows, spans)):
        seqs[i, : row.numel()] = row
        attn[i, : row.numel()] = 1
        mask[i, prompt_len - 1 : prompt_len - 1 + r] = 1
    return {
        "sequences": seqs,
        "attention_mask": attn,
        "action_mask": mask,
        "advantages": torch.randn(mask.shape, generator=gen) * mask,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="tiny")
    parser.add_argument("--job", choices=tuple(JOBS), default="demo")
    add_dtype_option(parser)
    parser.add_argument("--groups", type=int, default=8, help="prompts in the batch")
    parser.add_argument("--n", type=int, default=8, help="responses per prompt")
    parser.add_argument("--max_tokens", type=int, default=None, help="token budget a micro-batch (default: 2 groups)")
    parser.add_argument(
        "--micro_rows", type=int, default=None, help="rows a micro-batch instead of a token budget (the demo: 8)"
    )
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    args.dtype = resolve_dtype(args.dtype)

    import torch

    from openppo.models.actor import Actor
    from openppo.models.row_layout import RowLayout
    from openppo.ppo.batching import Batching, ForwardChunks, prompt_shares
    from openppo.ppo.config import AlgoConfig
    from openppo.ppo.fit import actor_loss, fit_experience
    from openppo.strategy.config import DeepSpeedConfig
    from openppo.strategy.deepspeed_strategy import DeepSpeedStrategy

    rows = args.groups * args.n
    strategy = DeepSpeedStrategy(
        DeepSpeedConfig(zero_stage=0, param_dtype=args.dtype, dist_timeout=600),
        train_batch_size=rows,
        micro_batch_size=1,
        max_norm=1.0,
        seed=0,
    )
    strategy.setup_distributed()
    model = Actor.from_pretrained(model_path(args.model), dtype=strategy.torch_dtype)
    engine = timing_engine(strategy, model)
    prompt_len, response = JOBS[args.job]
    data = group_batch(args.groups, args.n, prompt_len, response, model.config.vocab_size, seed=0)
    lengths = data["attention_mask"].sum(-1)
    budget = args.max_tokens or int(2 * args.n * lengths.float().mean())  # 2 groups of plain packed rows
    shared_tokens = sum(prompt_shares(data))
    if args.micro_rows:
        budget = None
    cut = dict(rows=args.micro_rows or 1, max_tokens=budget)
    variants = {"packed": Batching(packed=True, **cut), "shared": Batching(packed=True, share_prompts=True, **cut)}

    def layout(b: Batching) -> None:
        engine.module.layout = RowLayout(packed=True, share_prompts=b.share_prompts)

    @torch.no_grad()
    def forward(b: Batching) -> torch.Tensor:
        layout(b)
        chunks = ForwardChunks(engine, strategy, data, b)
        for m in chunks:
            chunks.add(engine(m["sequences"], m["attention_mask"], score_mask=m["action_mask"]).log_probs)
        return chunks.result()

    data["old_log_probs"] = forward(variants["packed"])
    valid = data["action_mask"].bool()
    # the same weights for both: shared prompts change the compute, not the numbers
    max_diff = (forward(variants["shared"]) - data["old_log_probs"])[valid].abs().max().item()
    algo = AlgoConfig(advantage_estimator="group_norm", init_kl_coef=0.0)

    def train(b: Batching) -> dict:
        layout(b)
        loss_fn = actor_loss(
            engine,
            algo,
            kl_coef=0.0,
            temperature=1.0,
            generate_max_len=response[1],
            is_correction=None,
            is_threshold=(0.5, 5.0),
        )
        step = dict(batching=b, rows_per_step=rows, epochs=1, world_size=1, seed=0, device=strategy.device)
        return fit_experience(engine, data, loss_fn, **step)

    times: dict[str, dict[str, list[float]]] = {name: {"forward": [], "train": []} for name in variants}
    metrics: dict[str, dict] = {}
    for repeat in range(args.repeats + 1):  # round 0 is the warm-up
        for name, b in variants.items():
            t0 = time.perf_counter()
            forward(b)
            t1 = time.perf_counter()
            metrics[name] = train(b)
            t2 = time.perf_counter()
            if repeat:
                times[name]["forward"].append(t1 - t0)
                times[name]["train"].append(t2 - t1)
            print(f"round {repeat} {name}: forward {t1 - t0:.2f} s, update {t2 - t1:.2f} s", flush=True)
    best = {name: {k: min(v) for k, v in t.items()} for name, t in times.items()}
    total = int(lengths.sum())
    emit(
        {
            "bench": "shared_prompts",
            "model": args.model,
            "job": args.job,
            "dtype": args.dtype,
            "groups": args.groups,
            "n": args.n,
            "token_budget": budget,
            "micro_rows": args.micro_rows,
            "tokens": {"packed": total, "shared": total - shared_tokens},
            "shared_share": round(shared_tokens / total, 3),
            "update_shared_prompt_share": round(metrics["shared"]["perf/shared_prompt_share"], 3),
            "micro_batches": {name: m["perf/micro_batches"] for name, m in metrics.items()},
            "seconds": best,
            "update_speedup": round(best["packed"]["train"] / best["shared"]["train"], 2),
            "forward_speedup": round(best["packed"]["forward"] / best["shared"]["forward"], 2),
            "max_logprob_diff": max_diff,
            "threads": torch.get_num_threads(),
        }
    )


if __name__ == "__main__":
    main()
