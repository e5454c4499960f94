"""Benchmark: the training step's speed options side by side, in one sitting (issue 34's table).

    python bench/train_step_table.py                          # GPU: the 0.5B shape, 1k and 4k rows, bf16
    .venv/bin/python bench/train_step_table.py --model tiny --lengths 128,256 --micro_tokens 512 --dtype fp32  # CPU

For each row length and each variant (the plain step; --torch_compile; both with 4x the tokens a micro-batch;
the chunked head (--lm_head_chunk_tokens) compiled with 4x; the compiled layers replayed as CUDA graphs;
--use_liger_kernel; the chunked head with Liger, also
with 4x; the chunked head) it runs
`bench/train_step_mfu.py` in a process of its own (Liger patches transformers' modules, and each variant's peak memory
must be its own), and prints one table: step time, tokens/s, MFU against the data sheet and against a matmul timed
in the same process, the allocator's peak memory and the memory planner's figure for the same update with their
ratio, and the optimizer steps DeepSpeed skipped for non-finite gradients (a row with any does not time a working
update). Every micro-batch holds `--micro_tokens` tokens (8 rows of 1024, 2 of 4096), and a step `--micro_batches`
of them.

A fresh GPU box pays each variant's start (imports, model load) and the compiled variants their compile: the runs
go in order of importance (`ORDER`: the plain step, the compiled layers and larger micro-batches first), and the
ones that would start after `--budget_s` are skipped and named, so that the call fits its lease. The last line
printed is one JSON object with every row and the device.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.record import MODELS, add_dtype_option, emit  # noqa: E402

BOTH = ["--lm_head_chunk_tokens", "{chunk}", "--use_liger_kernel"]
VARIANTS = {  # name -> (train_step_mfu.py flags ({chunk}: --chunk_tokens), micro-batch tokens x --micro_tokens)
    "plain": ([], 1),
    "chunked head": (["--lm_head_chunk_tokens", "{chunk}"], 1),
    "Liger": (["--use_liger_kernel"], 1),
    "compile": (["--torch_compile"], 1),
    # the options that go together (--use_liger_kernel with --torch_compile is refused: non-finite gradients on an
    # H200, openppo.models.kernels)
    "chunked + Liger": (BOTH, 1),
    # the launch-bound step's other lever: 4x the tokens a micro-batch (fewer, larger kernels), which the chunked
    # head's saved logits make room for; at the longest length only
    "chunked + Liger 4x micro": (BOTH, 4),
    "plain 4x micro": ([], 4),  # what the larger micro-batches give alone
    # the best of the second sitting of 2026-11-30 (22.0 % MFU at 4k): with the host's waits gone the compiled
    # layers' fused element-wise work shows, most with larger micro-batches
    "compile 4x micro": (["--torch_compile"], 4),
    # since e54cedb --torch_compile also compiles the chunked head's chunk math: the chunked head's memory with the
    # compiled layers' speed, at 4x micro-batches
    "chunked + compile 4x micro": (["--lm_head_chunk_tokens", "{chunk}", "--torch_compile"], 4),
    # CUDA graphs (issue 34 item 3): the compiled step at 8192 tokens a micro-batch had its GPU idle a third of the
    # time (0.469 s of kernels in a 0.703-s step, 16,308 kernels, each launched from Python); replayed graphs launch
    # each piece of a layer at once. The rows are of one length here, so each layer records once
    "compile + CUDA graphs": (["--torch_compile", "--compile_mode", "reduce-overhead"], 1),
}
# the order of importance (when the budget is short, the last are skipped): each at every row length, the 4x
# micro-batch variants at the longest only
ORDER = (
    "plain",
    "compile",
    "compile 4x micro",
    "chunked + compile 4x micro",
    "compile + CUDA graphs",
    "plain 4x micro",
    "Liger",
    "chunked + Liger 4x micro",
    "chunked + Liger",
    "chunked head",
)
COLUMNS = (
    "step_s",
    "tokens_per_s",
    "mfu_datasheet",
    "mfu_datasheet_with_attention",
    "mfu_vs_matmul",
    "peak_memory_gib",
    "planned_gib",
    "skipped_steps",  # non-finite gradients: the row's times are not those of a working update
)


# the larger micro-batch variants that also run at every length: the compiled one was the best step at 4k, and on
# GPUs the default token budget is now 32768 (4x), so it is what a 1k-row run gets by default (issue 34: 2x at 1k)
EVERY_LENGTH = ("compile 4x micro",)


def runs(lengths: list[int], variants: list[str]) -> list[tuple[str, int]]:
    """(variant, row length) in the order they run (`ORDER`: the first when the budget is short), each variant at
    every length but those with larger micro-batches, at the longest only (but `EVERY_LENGTH`); only `variants`."""
    return [
        (v, n)
        for v in ORDER
        if v in variants
        for n in ([max(lengths)] if VARIANTS[v][1] > 1 and v not in EVERY_LENGTH else lengths)
    ]


def table(rows: list[dict]) -> str:
    head = ["variant", "row", "rows/micro", *COLUMNS, "planned/peak"]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        peak, plan = r.get("peak_memory_gib"), r.get("planned_gib")
        ratio = f"{plan / peak:.2f}" if peak and plan else "-"
        cells = (
            [r["variant"], str(r["seq_len"]), str(r.get("micro", "-"))]
            + [str(r.get(c, "-")) for c in COLUMNS]
            + [ratio]
        )
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="qwen0.5b")
    add_dtype_option(parser)
    parser.add_argument("--lengths", default="1024,4096", help="comma list of row lengths (tokens)")
    parser.add_argument("--micro_tokens", type=int, default=8192, help="tokens per micro-batch (rows x length)")
    parser.add_argument("--micro_batches", type=int, default=4, help="micro-batches per optimizer step")
    parser.add_argument(
        "--chunk_tokens",
        type=int,
        default=1024,
        help="--lm_head_chunk_tokens of the chunked rows (4096 raised the 0.5B step's peak on an H200: a chunk's fp32 "
        "logits, exponentials and gradient outweighed the bf16 logits they replace)",
    )
    parser.add_argument("--steps", type=int, default=3, help="steps per run (the first is left out of the mean)")
    parser.add_argument("--budget_s", type=float, default=380, help="start no run after this many seconds")
    parser.add_argument(
        "--variants", default=",".join(ORDER), help=f"comma list of the variants to run, of: {', '.join(ORDER)}"
    )
    parser.add_argument("--out", type=Path, default=None, help="also write each run's log here (a folder)")
    args = parser.parse_args()
    lengths = [int(n) for n in args.lengths.split(",")]
    variants = [v.strip() for v in args.variants.split(",")]
    if unknown := set(variants) - set(VARIANTS):
        raise SystemExit(f"--variants: unknown {sorted(unknown)}; the variants are {', '.join(ORDER)}")
    if any(args.micro_tokens % n for n in lengths):
        raise SystemExit(f"--micro_tokens {args.micro_tokens} must be a multiple of every length in --lengths")
    start, rows, skipped = time.monotonic(), [], []
    for variant, length in runs(lengths, variants):
        elapsed = time.monotonic() - start
        if elapsed > args.budget_s:
            skipped.append(f"{variant} @ {length}")
            continue
        flags, scale = VARIANTS[variant]
        micro = scale * args.micro_tokens // length
        flags = [f.format(chunk=args.chunk_tokens) for f in flags]
        cmd = [sys.executable, str(REPO / "bench" / "train_step_mfu.py"), "--model", args.model, "--dtype"]
        cmd += [args.dtype, "--seq_len", str(length), "--micro", str(micro), "--rows", str(micro * args.micro_batches)]
        cmd += ["--steps", str(args.steps), *flags]
        began = time.monotonic()
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
        took = time.monotonic() - began
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / f"{variant.replace(' ', '_')}_{length}.log").write_text(proc.stdout + proc.stderr)
        records = [line for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode or not records:
            print(f"{variant} @ {length}: failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}", file=sys.stderr)
            rows.append(
                {
                    "variant": variant,
                    "seq_len": length,
                    "micro": micro,
                    "failed": proc.returncode,
                    "run_s": round(took, 1),
                }
            )
            continue
        record = json.loads(records[-1])
        record.pop("device", None)
        rows.append({"variant": variant, **record, "run_s": round(took, 1)})
        print(f"{variant} @ {length}: {took:.0f} s", file=sys.stderr, flush=True)
    rows.sort(key=lambda r: (r["seq_len"], list(VARIANTS).index(r["variant"])))
    print(table(rows))
    if skipped:
        print(f"skipped (past --budget_s {args.budget_s:.0f} s): {', '.join(skipped)}")
    emit(
        {
            "bench": "train_step_table",
            "model": args.model,
            "micro_tokens": args.micro_tokens,
            "micro_batches": args.micro_batches,
            "rows": rows,
            "skipped": skipped,
            "total_s": round(time.monotonic() - start, 1),
        }
    )


if __name__ == "__main__":
    main()
