"""Benchmark: the LM head in chunks (--lm_head_chunk_tokens) against the model's full logits, in peak memory and time
of the actor's scoring pass with its backward.

    .venv/bin/python bench/lm_head.py                                  # Qwen2.5-0.5B's head on 2 layers, CPU
    .venv/bin/python bench/lm_head.py --rows 8 --seq_len 4096 --chunk 4096   # a GPU's micro-batch

Each variant runs in a process of its own (a process's peak memory only grows): the `Actor` loaded in the run's
precision, one warm-up step, then `--steps` timed steps. A step is what the update does to a padded micro-batch:
log-probs of the response half (the prompt half skipped, as the action mask makes the trainer do) with the logged
entropy, then the backward of a GRPO-like weighted sum of them. Peak memory is the step's peak above what the process
held before it: the peak resident set (VmHWM, reset before the step) on a CPU, `max_memory_allocated` on a GPU. The
last line printed is one JSON object with both variants, the ratios chunked / full from this invocation, and the
device (`bench/record.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.record import MODELS, add_dtype_option, emit, model_path, resolve_dtype  # noqa: E402

GIB = 2**30


def _resident_peak_reset() -> None:
    """Reset the process's peak resident set (Linux: VmHWM) to its current size."""
    Path("/proc/self/clear_refs").write_text("5")


def _resident_peak() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def _resident_now() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def child(args) -> dict:
    """One variant: the step's time and peak memory above the step's start."""
    import torch

    from openppo.models.actor import Actor

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    actor = Actor.from_pretrained(model_path(args.model), dtype=dtype).to(device)
    actor.train()
    why = actor.chunk_head(args.chunk)
    if why:
        raise SystemExit(f"--chunk: {why}")
    vocab = actor.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    seqs = torch.randint(100, vocab - 100, (args.rows, args.seq_len), generator=gen).to(device)
    mask = torch.zeros(args.rows, args.seq_len - 1, device=device)
    mask[:, args.seq_len // 2 - 1 :] = 1
    weights = torch.randn(args.rows, args.seq_len - 1, generator=gen).to(device) * mask
    times, peaks = [], []
    for step in range(args.steps + 1):  # the first warms up
        actor.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        else:
            _resident_peak_reset()
            base = _resident_now()
        start = time.perf_counter()
        out = actor(seqs, torch.ones_like(seqs), score_mask=mask, return_entropy="log")
        (out.log_probs * weights).sum().backward()
        if cuda:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        peak = (torch.cuda.max_memory_allocated() if cuda else _resident_peak()) - base
        if step:
            times.append(elapsed)
            peaks.append(peak)
        print(f"chunk {args.chunk} step {step}: {elapsed:.2f} s, peak +{peak / GIB:.2f} GiB", file=sys.stderr)
    return {"step_s": round(statistics.fmean(times), 3), "peak_gib": round(max(peaks) / GIB, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="qwen0.5b-2l")
    add_dtype_option(parser)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=1024, help="tokens a row; the second half is scored")
    parser.add_argument("--chunk", type=int, default=256, help="--lm_head_chunk_tokens of the chunked variant")
    parser.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.dtype = resolve_dtype(args.dtype)
    if args.child:
        print(json.dumps(child(args)))
        return
    model_path(args.model)  # built once, before the variants time anything
    results = {}
    for chunk in (0, args.chunk):
        cmd = [sys.executable, __file__, "--child", "--model", args.model, "--dtype", args.dtype]
        cmd += ["--rows", str(args.rows), "--seq_len", str(args.seq_len), "--chunk", str(chunk)]
        cmd += ["--steps", str(args.steps)]
        # every tensor of 64 KiB or more gets its own mapping, handed back when freed: the resident set then follows
        # the live tensors, and its peak is theirs (glibc's heap would keep freed memory resident)
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=3600, env=env)
        sys.stderr.write(proc.stderr[-2000:])
        if proc.returncode != 0:
            raise SystemExit(f"variant --chunk {chunk} failed (exit {proc.returncode})")
        results["full" if chunk == 0 else "chunked"] = json.loads(proc.stdout.strip().splitlines()[-1])
    full, chunked = results["full"], results["chunked"]
    emit(
        {
            "bench": "lm_head",
            "model": args.model,
            "dtype": args.dtype,
            "rows": args.rows,
            "seq_len": args.seq_len,
            "scored_tokens": args.rows * (args.seq_len // 2),
            "chunk": args.chunk,
            "full": full,
            "chunked": chunked,
            "peak_ratio": round(chunked["peak_gib"] / full["peak_gib"], 3),
            "time_ratio": round(chunked["step_s"] / full["step_s"], 3),
        }
    )


if __name__ == "__main__":
    main()
