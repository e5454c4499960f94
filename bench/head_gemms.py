"""Benchmark: the LM head's three matmuls alone, at the shapes the training step gives them, in TFLOP/s, with the
kernel each one ran.

    python bench/head_gemms.py                                   # Qwen2.5-0.5B's head (896 x 151,936), on a GPU
    .venv/bin/python bench/head_gemms.py --hidden 64 --vocab 1000 --tokens 64 256   # a dry run on a CPU

The first H200 profile (docs/benchmarks.md) found the head's three GEMMs (8192 tokens x 896 x 151,936) running at
190-290 TFLOP/s in sm75 CUTLASS kernels, where a square bf16 matmul of the same process ran at 770: a fifth of the
step's kernel time. Before the head's code changes, this says which shape is slow and what would help, for each
`--tokens` (a micro-batch's scored positions, or a chunk of --lm_head_chunk_tokens):
- `forward`: logits = hidden [T, H] @ weight[V, H]^T, as `F.linear`;
- `grad_hidden`: grad_logits [T, V] @ weight [V, H] (K = V, the vocabulary);
- `grad_weight`: grad_logits^T [V, T] @ hidden [T, H] (K = T);
each with the vocabulary as the model has it and padded to a multiple of `--pad_to` (a head padded with zero rows
stays exact if it masks the padded logits), and with torch's BLAS preference as it is and set to cuBLASLt. Times
are CUDA events around each call, the median of `--repeats` after a warm-up; kernel names from torch's profiler. The
last line printed is one JSON object naming the device (`bench/record.py`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.record import emit  # noqa: E402

GEMMS = ("forward", "grad_hidden", "grad_weight")


def padded(vocab: int, multiple: int) -> int:
    """`vocab` rounded up to a multiple of `multiple`."""
    return -(-vocab // multiple) * multiple


def operands(tokens: int, hidden: int, vocab: int, dtype, device):
    """The three GEMMs' callables on fresh operands of the step's shapes (grad_logits: [T, V] like the logits)."""
    import torch
    import torch.nn.functional as F

    h = torch.randn(tokens, hidden, device=device, dtype=dtype)
    w = torch.randn(vocab, hidden, device=device, dtype=dtype) / hidden**0.5
    g = torch.randn(tokens, vocab, device=device, dtype=dtype) / vocab**0.5
    return {
        "forward": lambda: F.linear(h, w),
        "grad_hidden": lambda: g @ w,
        "grad_weight": lambda: g.t() @ h,
    }


def seconds(fn, device, repeats: int) -> float:
    """Median seconds of `fn()` after one warm-up call (CUDA events on a GPU, the wall clock on a CPU)."""
    import torch

    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            began = time.perf_counter()
            fn()
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def kernel_names(fn, device) -> list[str]:
    """The device kernels (GPU) or the operators (CPU) one call of `fn` ran, costliest first."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        if device.type == "cuda":
            import torch

            torch.cuda.synchronize()
    if device.type == "cuda":
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
        return [e.name for e in sorted(kernels, key=lambda e: -e.device_time)][:2]
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
    return [e.key for e in ops if e.key.startswith("aten::")][:2]


def measure(args, device, dtype) -> list[dict]:
    import torch

    rows = []
    blas = ["default"] + (["cublaslt"] if device.type == "cuda" else [])
    vocabs = sorted({args.vocab, padded(args.vocab, args.pad_to)})
    for library in blas:
        if library != "default":
            torch.backends.cuda.preferred_blas_library(library)
        for vocab in vocabs:
            for tokens in args.tokens:
                calls = operands(tokens, args.hidden, vocab, dtype, device)
                for gemm in GEMMS:
                    s = seconds(calls[gemm], device, args.repeats)
                    flops = 2 * tokens * args.hidden * vocab
                    row = {
                        "blas": library,
                        "vocab": vocab,
                        "tokens": tokens,
                        "gemm": gemm,
                        "ms": float(f"{s * 1e3:.4g}"),
                        "tflops": float(f"{flops / s / 1e12:.4g}"),  # (4 digits: toy sizes on a CPU are tiny)
                        "kernels": kernel_names(calls[gemm], device),
                    }
                    rows.append(row)
                    print(
                        f"{library:8} V={vocab:6} T={tokens:6} {gemm:11} {row['ms']:9.3f} ms {row['tflops']:7.1f} "
                        f"TFLOP/s  {row['kernels'][0][:90] if row['kernels'] else ''}",
                        flush=True,
                    )
                del calls
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    return rows


def square_tflops(device, dtype, size: int, repeats: int) -> float:
    """A size-cube matmul's TFLOP/s in the same process: what this device's BLAS reaches on an easy shape."""
    import torch

    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    return 2 * size**3 / seconds(lambda: a @ b, device, repeats) / 1e12


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 8192, 32768])
    parser.add_argument("--pad_to", type=int, default=256, help="also time the vocabulary padded to this multiple")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--square", type=int, default=8192, help="the reference square matmul's size")
    args = parser.parse_args()

    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    square = square_tflops(device, dtype, args.square, args.repeats)
    print(f"square {args.square}^3 matmul: {square:.1f} TFLOP/s", flush=True)
    rows = measure(args, device, dtype)
    emit(
        {
            "bench": "head_gemms",
            "hidden": args.hidden,
            "dtype": args.dtype,
            "square_tflops": float(f"{square:.4g}"),
            "rows": rows,
        }
    )


if __name__ == "__main__":
    main()
