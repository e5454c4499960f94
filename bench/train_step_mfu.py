"""Benchmark: model FLOPs utilisation (MFU) of openppo's actor update, the GPU variant of the TRL comparison.

    .venv/bin/python bench/train_step_mfu.py                       # 0.5B-class model, auto dtype, ZeRO-2 (GPU)
    .venv/bin/python bench/train_step_mfu.py --model tiny --rows 8 --seq_len 128   # a quick look on CPU
    .venv/bin/python bench/train_step_mfu.py --model smollm2 --rows 16 --seq_len 96 --dtype fp32   # CPU, real model
    python bench/train_step_mfu.py --steps 4 --profile 25       # where a GPU step's time goes (last step profiled)
    python bench/train_step_mfu.py --steps 5 --timeline         # GPU busy share, host syncs and their sites
    python bench/train_step_mfu.py --steps 3 --memory_breakdown # what the last step's peak memory holds (GPU)
    python bench/train_step_mfu.py --lm_head_chunk_tokens 4096  # the LM head in chunks (--lm_head_chunk_tokens)
    python bench/train_step_mfu.py --use_liger_kernel           # Liger's RMSNorm, RoPE, SwiGLU (--use_liger_kernel)
    python bench/train_step_mfu.py --torch_compile              # the decoder layers compiled (--torch_compile)

The update is the trainer's own: `Actor` (sdpa, varlen attention for packed rows) under `DeepSpeedStrategy`, the
GRPO policy loss (`actor_loss`), micro-batches and optimizer steps by `fit_experience`, one rank. Rows are random
token ids (MFU does not depend on the values): `--rows` rows of `--seq_len` tokens per optimizer step, half
prompt, half response, `--micro` rows per micro-batch, packed as with --packing_samples (padded with --no-pack).
The `qwen0.5b` model has Qwen2.5-0.5B's shape (24 layers, hidden 896, MLP 4864, the Qwen3 tokenizer's 151k
vocabulary, tied embeddings; one KV head per query head, so 0.53B parameters) with random weights, built once into
`.cache/bench/models`.

Step time is the mean wall time of steps 2..N (step 1 pays the allocator and kernel warm-ups). FLOPs per step are
6 x parameters x tokens (8 x with --gradient_checkpointing; `openppo.ppo.reporting.train_flops`), the count the
trainer's own `perf/actor_mfu` uses. MFU is reported twice: against the device's data-sheet dense peak when it is
listed (`throughput.peak_flops`: H100, H200, A100...; none for CPUs), and against a large matmul in the same dtype
timed in this process (the device's practical peak), which also gives CPU runs a ratio. The last line printed is
one JSON object, with the device it ran on (CPU model and PyTorch's CPU capability, or the GPU name;
`bench/record.py`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.peak_memory import peak_breakdown  # noqa: E402
from bench.record import MODELS, add_dtype_option, emit, model_path, resolve_dtype, timing_engine  # noqa: E402
from bench.timeline import SyncSites, trace_summary  # noqa: E402


def matmul_peak(device, dtype, size: int, repeats: int = 10) -> float:
    """FLOP/s of a size x size x size matmul in `dtype` on `device`, best of `repeats`."""
    import torch

    a, b = (torch.randn(size, size, device=device).to(dtype) for _ in range(2))
    best = float("inf")
    for _ in range(repeats + 1):  # the first is a warm-up
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def profiler(device, with_stack: bool = False):
    """torch's profiler over the host and, on a GPU, its kernels; `with_stack`: also the Python frames, which name
    the lines that launched each kernel (`timeline.kernel_time_by_source`)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    return profile(activities=activities, with_stack=with_stack)


def planned_gib(args, path: str, shape=None) -> float:
    """The memory planner's figure for this update's device (`openppo.ppo.memory_plan`, the one `python -m
    openppo.cli.plan` prints): the actor's weights, gradients, optimizer states and working memory, with the flags of
    a train_ppo_ray run whose micro-batches are this bench's. `shape`: the model's (default: read from `path`)."""
    from openppo.cli.plan import PlanConfig
    from openppo.config.schema import parse_config
    from openppo.ppo.memory_plan import GIB, model_shape, plan_devices

    response = args.seq_len // 2
    flags = f"--pretrain {path} --prompt_data p.jsonl --remote_rm_url r.py --advantage_estimator reinforce "
    flags += f"--n_samples_per_prompt 1 --init_kl_coef 0 --rollout_batch_size {args.rows} "
    flags += f"--train_batch_size {args.rows} --micro_train_batch_size {args.micro} --micro_rollout_batch_size "
    flags += f"{args.micro} --prompt_max_len {args.seq_len - response} --generate_max_len {response} --zero_stage "
    flags += f"{args.zero_stage} --param_dtype {args.dtype} --lm_head_chunk_tokens {args.lm_head_chunk_tokens}"
    flags += " --packing_samples" * args.pack + " --gradient_checkpointing" * args.gradient_checkpointing
    flags += " --use_liger_kernel" * args.use_liger_kernel + " --torch_compile" * args.torch_compile
    cfg = parse_config(PlanConfig, flags.split(), "plan")
    # (the device size sizes only engines' KV caches, which this plan has none of)
    plans = plan_devices(cfg, {"actor": shape or model_shape(path, "--pretrain")}, 80 * GIB, on_gpu=True)
    return next(p for p in plans if p.name == "actor device").device_bytes / GIB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=MODELS, default="qwen0.5b")
    add_dtype_option(parser)
    parser.add_argument("--zero_stage", type=int, default=2)
    parser.add_argument("--rows", type=int, default=32, help="rows per optimizer step")
    parser.add_argument("--seq_len", type=int, default=1024, help="tokens per row (half prompt, half response)")
    parser.add_argument("--micro", type=int, default=8, help="rows per micro-batch")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--gradient_checkpointing", action="store_true")
    parser.add_argument(
        "--lm_head_chunk_tokens", type=int, default=0, metavar="N", help="the LM head in chunks of N positions (0: off)"
    )
    parser.add_argument("--use_liger_kernel", action="store_true", help="Liger's kernels in the model (GPU)")
    parser.add_argument("--torch_compile", action="store_true", help="compile the decoder layers (step 1 compiles)")
    parser.add_argument(
        "--compile_mode",
        choices=("default", "reduce-overhead", "max-autotune-no-cudagraphs"),
        default="default",
        help="torch.compile's mode for the layers with --torch_compile: reduce-overhead replays them as CUDA graphs "
        "(the rows here are all one length, so each layer records once)",
    )
    parser.add_argument(
        "--pack",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="packed micro-batches (--packing_samples), or padded ones with --no-pack",
    )
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="profile the last step and print its N costliest operators by device time (stderr)",
    )
    parser.add_argument(
        "--timeline",
        action="store_true",
        help="GPU: count the host's waits on the GPU in the step before last, by the line that caused them, and read "
        "the last step's profile for the GPU's busy share and its kernel time by kind (bench/timeline.py)",
    )
    parser.add_argument(
        "--memory_breakdown",
        action="store_true",
        help="GPU: record the last step's allocations and sum what is alive at its peak by the line that allocated "
        "it (bench/peak_memory.py); not with --profile or --timeline",
    )
    parser.add_argument(
        "--trim",
        action="store_true",
        help="hand the freed heap back to the OS after every step (malloc_trim), to measure its cost",
    )
    args = parser.parse_args()
    args.dtype = resolve_dtype(args.dtype)
    # the last (profiled or memory-traced), the one before (--timeline's waits): left out of the mean
    profiled_steps = int(bool(args.profile) or args.timeline or args.memory_breakdown) + args.timeline
    if args.compile_mode != "default" and not args.torch_compile:
        raise SystemExit("--compile_mode: add --torch_compile (the mode is the compiled layers')")
    if args.memory_breakdown and (args.profile or args.timeline):
        raise SystemExit("--memory_breakdown traces the last step's allocations: run it without --profile/--timeline")
    if args.steps < 2 + profiled_steps or args.rows % args.micro or args.seq_len < 4:
        raise SystemExit(
            "--steps must be >= 2 (3 with --profile, 4 with --timeline), --rows a multiple of --micro, --seq_len >= 4"
        )
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
    from openppo.strategy.distributed import free_port

    os.environ.setdefault("MASTER_PORT", str(free_port()))
    import torch

    from openppo.models.actor import Actor
    from openppo.models.kernels import liger_notice
    from openppo.models.row_layout import RowLayout
    from openppo.ppo.batching import Batching
    from openppo.ppo.config import AlgoConfig
    from openppo.ppo.fit import actor_loss, fit_experience
    from openppo.ppo.reporting import attention_flops, mfu, peak_flops, train_flops
    from openppo.strategy.config import DeepSpeedConfig
    from openppo.strategy.deepspeed_strategy import DeepSpeedStrategy
    from openppo.utils.hardware import trim_host_heap

    path = model_path(args.model)
    strategy = DeepSpeedStrategy(
        DeepSpeedConfig(zero_stage=args.zero_stage, param_dtype=args.dtype, dist_timeout=600),
        train_batch_size=args.rows,
        micro_batch_size=args.micro,
        max_norm=1.0,
        seed=0,
    )
    strategy.setup_distributed()
    actor = Actor.from_pretrained(
        str(path),
        dtype=strategy.torch_dtype,
        gradient_checkpointing=args.gradient_checkpointing,
        use_liger_kernel=args.use_liger_kernel,
        torch_compile=args.torch_compile and args.compile_mode == "default",
    )
    if args.compile_mode != "default":  # the same compiled layers and scoring, in the mode asked for
        from openppo.models.kernels import compile_layers

        compile_layers(actor.model, mode=args.compile_mode)
        actor.compiled_scoring = True
    if args.use_liger_kernel and (why := liger_notice(True, strategy.device.type == "cuda")):
        print(why, file=sys.stderr)
    if why := actor.chunk_head(args.lm_head_chunk_tokens):
        raise SystemExit(f"--lm_head_chunk_tokens: {why}")
    num_params = sum(p.numel() for p in actor.parameters())
    engine = timing_engine(strategy, actor, lr=1e-6)
    response = args.seq_len // 2
    vocab = actor.model.config.vocab_size
    loss_fn = actor_loss(
        engine,
        AlgoConfig(advantage_estimator="group_norm", init_kl_coef=0.0),
        kl_coef=0.0,
        temperature=1.0,
        generate_max_len=response,
        is_correction=None,
        is_threshold=(0.5, 5.0),
    )
    actor.layout = RowLayout(packed=args.pack)
    gen = torch.Generator().manual_seed(0)
    times, timeline, breakdown = [], {}, {}
    if args.timeline and strategy.device.type != "cuda":
        print("--timeline reads the GPU's kernels and the host's waits on them: no effect on CPU", file=sys.stderr)
    if args.memory_breakdown and strategy.device.type != "cuda":
        print("--memory_breakdown reads the GPU allocator's record: no effect on CPU", file=sys.stderr)
    if strategy.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for step in range(args.steps):
        seqs = torch.randint(100, vocab - 100, (args.rows, args.seq_len), generator=gen)
        mask = torch.zeros(args.rows, args.seq_len - 1)
        mask[:, args.seq_len - response - 1 :] = 1
        data = {
            "sequences": seqs,
            "attention_mask": torch.ones_like(seqs),
            "action_mask": mask,
            "advantages": torch.randn(args.rows, args.seq_len - 1, generator=gen) * mask,
        }
        if strategy.device.type == "cuda":
            torch.cuda.synchronize()
        profiled = (args.profile or args.timeline) and step == args.steps - 1
        on_gpu = strategy.device.type == "cuda"
        counting = args.timeline and on_gpu and step == args.steps - 2
        tracing = args.memory_breakdown and on_gpu and step == args.steps - 1
        if tracing:  # the step's own peak, against which the replayed one is checked
            torch.cuda.reset_peak_memory_stats()
            start_bytes = torch.cuda.memory_allocated()
            torch.cuda.memory._record_memory_history(max_entries=4_000_000, stacks="python")
        start = time.perf_counter()
        with (
            profiler(strategy.device, with_stack=args.timeline) if profiled else contextlib.nullcontext() as prof,
            SyncSites(REPO) if counting else contextlib.nullcontext() as syncs,
        ):
            fit_experience(
                engine,
                data,
                loss_fn,
                batching=Batching(packed=args.pack, rows=args.micro),
                rows_per_step=args.rows,
                epochs=1,
                world_size=1,
                seed=step,
                device=strategy.device,
            )
            if strategy.device.type == "cuda":
                torch.cuda.synchronize()
        if profiled and args.profile:
            by = "self_cuda_time_total" if strategy.device.type == "cuda" else "self_cpu_time_total"
            print(prof.key_averages().table(sort_by=by, row_limit=args.profile), file=sys.stderr)
        if profiled and args.timeline and on_gpu:
            try:  # a record without its timeline is still a record
                with tempfile.TemporaryDirectory() as tmp:
                    prof.export_chrome_trace(f"{tmp}/trace.json")
                    timeline["profiled_step"] = trace_summary(json.loads(Path(f"{tmp}/trace.json").read_text()))
            except Exception as error:  # noqa: BLE001
                timeline["error"] = repr(error)
        if counting:
            timeline.update(host_syncs=syncs.count, sync_sites=dict(syncs.sites.most_common(12)))
        if tracing:
            try:  # a record without its breakdown is still a record
                snapshot = torch.cuda.memory._snapshot()
                torch.cuda.memory._record_memory_history(enabled=None)
                trace = snapshot["device_traces"][strategy.device.index or 0]
                breakdown = peak_breakdown(trace, start_bytes)
                breakdown["step_peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
            except Exception as error:  # noqa: BLE001
                breakdown = {"error": repr(error)}
        if args.trim:
            trim_host_heap(min_interval_s=0.0)
        times.append(time.perf_counter() - start)
        print(f"step {step + 1}/{args.steps}: {times[-1]:.2f} s", file=sys.stderr, flush=True)
    # the profiled and the sync-counting steps are slower: they are left out of the mean
    step_s = statistics.fmean(times[1 : len(times) - profiled_steps])
    tokens = args.rows * args.seq_len
    flops = train_flops(num_params, tokens, args.gradient_checkpointing)
    device = strategy.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    measured_peak = matmul_peak(device, strategy.torch_dtype, 8192 if device.type == "cuda" else 1024)
    sheet = mfu(flops, step_s, peak_flops(name, args.dtype))
    # the same with the attention's own FLOPs (PaLM's count, as torchtitan reports MFU): each row one sequence
    config = actor.model.config
    width = config.num_attention_heads * (
        getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    )
    attention = attention_flops(
        config.num_hidden_layers, width, [args.seq_len] * args.rows, args.gradient_checkpointing
    )
    sheet_with_attention = mfu(flops + attention, step_s, peak_flops(name, args.dtype))
    emit(
        {
            "bench": "train_step_mfu",
            "model": args.model,
            "params_m": round(num_params / 1e6, 1),
            "dtype": args.dtype,
            "zero_stage": args.zero_stage,
            "rows": args.rows,
            "seq_len": args.seq_len,
            "micro": args.micro,
            "packed": args.pack,
            "gradient_checkpointing": args.gradient_checkpointing,
            "lm_head_chunk_tokens": args.lm_head_chunk_tokens,
            "use_liger_kernel": args.use_liger_kernel,
            "torch_compile": args.torch_compile,
            "compile_mode": args.compile_mode,
            "trim": args.trim,
            "step_times_s": [round(t, 3) for t in times],
            # optimizer steps DeepSpeed skipped for a non-finite gradient: a row with any times a broken update
            "skipped_steps": int(engine.skipped_steps),
            "step_s": round(step_s, 3),
            "tokens_per_s": round(tokens / step_s, 1),
            "achieved_tflops": round(flops / step_s / 1e12, 3),
            "matmul_peak_tflops": round(measured_peak / 1e12, 3),
            "mfu_datasheet": None if sheet is None else round(sheet, 3),
            # counting the attention's FLOPs too (12 x layers x width x sequence length a token): the convention of
            # torchtitan and PaLM, above the 6 x params figure by that share (+33 % at 4k tokens for the 0.5B shape)
            "mfu_datasheet_with_attention": None if sheet_with_attention is None else round(sheet_with_attention, 3),
            "mfu_vs_matmul": round(flops / step_s / measured_peak, 3),
            # the steps' peak of the device's allocator (weights, optimizer states and activations); GPU only
            "peak_memory_gib": (
                round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None
            ),
            # the memory planner's figure for the same update (GPU arithmetic: FusedAdam; compare on a GPU)
            "planned_gib": round(planned_gib(args, str(path)), 2),
            # --timeline: the host's waits on the GPU in one step, by line, and the profiled step's busy share
            **({"timeline": timeline} if timeline else {}),
            # --memory_breakdown: the last step's peak by allocation site (its own allocator peak beside it)
            **({"memory_breakdown": breakdown} if breakdown else {}),
        }
    )


if __name__ == "__main__":
    main()
