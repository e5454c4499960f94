"""Where a GPU step's time goes: how long the device was busy, how often the host waited on it, and from where.

Two views of one step, for `bench/train_step_mfu.py --timeline`:
- `SyncSites`: every operation that makes the host wait for the GPU (`.item()`, a boolean-mask index, a copy to the
  host...), as `torch.cuda.set_sync_debug_mode` reports them, counted by the Python line that called it. A host that
  waits cannot queue the next kernels while the current ones run, so in a launch-bound step every wait leaves the GPU
  idle for the time the host then takes to launch the next kernels.
- `trace_summary`: a profiler trace (Chrome format) read back: the union of the kernels' intervals against the step's
  wall time, the kernels' time by kind (matmuls, attention, Triton, element-wise...), the small kernels' time by the
  Python line and host operator that launched them, and the host's time in the CUDA runtime's synchronising calls.
"""

from __future__ import annotations

import re
import traceback
import warnings
from collections import Counter
from pathlib import Path

KINDS = (  # (kind, pattern of the kernel's name), the first match wins
    ("matmul", re.compile(r"gemm|cutlass|xmma|nvjet|cublas|matmul", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa", re.I)),
    ("optimizer", re.compile(r"multi_tensor|adam", re.I)),
    # Inductor's kernels (triton_poi_..., triton_red_...) and Liger's (_rms_norm_forward_kernel, _triton_rope...)
    ("triton", re.compile(r"^triton_|^_triton|^_\w+_kernel$")),
    ("copy", re.compile(r"copy|memcpy|memset|cat_|index", re.I)),
    ("reduction", re.compile(r"reduce|norm|softmax|sum", re.I)),
    ("element-wise", re.compile(r"elementwise|vectorized|unrolled", re.I)),
)
SMALL_KINDS = ("copy", "element-wise", "reduction", "triton", "other")  # what fusing and fewer launches address
SYNC_CALLS = re.compile(r"^cuda(Stream|Device|Event)Synchronize$|^cudaMemcpy$|^cudaMemcpy(?!Async)")


def kernel_kind(name: str) -> str:
    """The kind of a GPU kernel or copy, from its name (`KINDS`; "other" when none matches)."""
    return next((kind for kind, pattern in KINDS if pattern.search(name)), "other")


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of (start, end) intervals: the time at least one of them ran."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def trace_summary(trace: dict, top: int = 15) -> dict:
    """Kernel and runtime figures of a profiler trace (`torch.profiler` exported in Chrome format; times in us):
    `wall_s` from the first to the last event on the device or the host's runtime, `gpu_busy_s` the union of the
    device's kernels, copies and sets, their share of the wall, the time by kind, the `top` costliest kernels, and
    the host's synchronising runtime calls (count and seconds)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    device = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    spans = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in device + runtime]
    wall = (max(end for _, end in spans) - min(start for start, _ in spans)) / 1e6 if spans else 0.0
    busy = busy_time([(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in device]) / 1e6
    kinds: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    by_name: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    for e in device:
        kind = "copy" if e["cat"] != "kernel" else kernel_kind(e.get("name", ""))
        kinds[kind] += float(e["dur"]) / 1e6
        counts[kind] += 1
        name = e.get("name", "")[:100]
        by_name[name] += float(e["dur"]) / 1e6
        calls[name] += 1
    syncs = [e for e in runtime if SYNC_CALLS.search(e.get("name", ""))]
    return {
        "wall_s": round(wall, 4),
        "gpu_busy_s": round(busy, 4),
        "gpu_busy_share": round(busy / wall, 3) if wall else None,
        "kernels": len(device),
        "kernel_s_by_kind": {k: round(v, 4) for k, v in kinds.most_common()},
        "kernels_by_kind": dict(counts.most_common()),
        # the costliest kernels: [name (100 characters), calls, seconds]
        "top_kernels": [[name, calls[name], round(sec, 4)] for name, sec in by_name.most_common(top)],
        "runtime_syncs": len(syncs),
        "runtime_sync_s": round(sum(float(e["dur"]) for e in syncs) / 1e6, 4),
        # where the time that is neither matmul nor attention comes from (`kernel_time_by_source`)
        "small_kernels_by_source": kernel_time_by_source(trace, SMALL_KINDS, top),
    }


# the Python frames that name a launch's source: this project's, transformers', DeepSpeed's, Liger's (not torch's module
# machinery, which wraps them all)
SOURCE_FRAMES = re.compile(r"openppo/|transformers/|deepspeed/|liger_kernel/")


def kernel_time_by_source(trace: dict, kinds: tuple[str, ...], top: int = 15) -> list[list]:
    """The device time of the kernels of `kinds` (`kernel_kind`), by what launched them on the host: the innermost
    Python frame of `SOURCE_FRAMES` around the launch (`python_function` events, in a profile that records stacks)
    and the outermost host operator around it (`cpu_op`: `aten::to`, or an autograd node's
    `autograd::engine::evaluate_function: ...Backward0`). A kernel is matched to its launch by the trace's
    correlation id. [source, kernels, seconds], the costliest `top` first."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    launches = {
        e["args"]["correlation"]: e
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    # the host's nested intervals and the launches, swept in time order per thread: the open intervals at a launch
    # are the ones around it, outermost first
    marks: list[tuple] = []
    for e in events:
        if e.get("cat") in ("cpu_op", "python_function"):
            marks.append((e.get("pid"), e.get("tid"), float(e["ts"]), 0, -float(e["dur"]), e))
    wanted = {}
    for e in events:
        if e.get("cat") == "kernel" and kernel_kind(e.get("name", "")) in kinds:
            launch = launches.get(e.get("args", {}).get("correlation"))
            if launch is not None:
                wanted.setdefault(id(launch), [launch, 0, 0.0])
                wanted[id(launch)][1] += 1
                wanted[id(launch)][2] += float(e["dur"]) / 1e6
    for launch, _, _ in wanted.values():
        marks.append((launch.get("pid"), launch.get("tid"), float(launch["ts"]), 1, 0.0, launch))
    marks.sort(key=lambda m: (str(m[0]), str(m[1]), m[2], m[3], m[4]))
    by_source: Counter[str] = Counter()
    calls: Counter[str] = Counter()
    stack: list[dict] = []
    thread = None
    for pid, tid, ts, is_launch, _, e in marks:
        if (pid, tid) != thread:
            thread, stack = (pid, tid), []
        while stack and float(stack[-1]["ts"]) + float(stack[-1]["dur"]) <= ts:
            stack.pop()
        if not is_launch:
            stack.append(e)
            continue
        frames = [m["name"] for m in stack if m.get("cat") == "python_function" and SOURCE_FRAMES.search(m["name"])]
        ops = [m["name"] for m in stack if m.get("cat") == "cpu_op"]
        source = f"{frames[-1] if frames else '-'} | {ops[0] if ops else '-'}"[:160]
        _, count, seconds = wanted[id(e)]
        by_source[source] += seconds
        calls[source] += count
    return [[source, calls[source], round(sec, 6)] for source, sec in by_source.most_common(top)]


def _site(stack: list[traceback.FrameSummary], root: Path) -> str:
    """The innermost frame of this repository's code, and the innermost frame of all, as one string."""
    inner = stack[-1]
    ours = next((f for f in reversed(stack) if Path(f.filename).resolve().is_relative_to(root)), None)
    where = f"{Path(inner.filename).name}:{inner.lineno} ({inner.name})"
    if ours is None or ours is inner:
        return where
    return f"{Path(ours.filename).resolve().relative_to(root)}:{ours.lineno} ({ours.name}) -> {where}"


class SyncSites:
    """Counts the operations that synchronise the host with the GPU while active, by the line that called them
    (`torch.cuda.set_sync_debug_mode("warn")`, whose warnings are caught here with the stack they were raised at)."""

    def __init__(self, root: Path):
        self.root = root.resolve()
        self.sites: Counter[str] = Counter()
        self.waits: list[tuple[str, list[traceback.FrameSummary]]] = []  # each wait's site and whole stack

    def __enter__(self) -> SyncSites:
        import torch

        self._catch = warnings.catch_warnings()
        self._catch.__enter__()
        warnings.simplefilter("always")
        self._show = warnings.showwarning

        def record(message, category, filename, lineno, file=None, line=None):
            if "synchronizing CUDA operation" in str(message):
                # the stack at the warning: the op's caller is below the warnings module's own frames
                stack = [f for f in traceback.extract_stack() if not f.filename.endswith("warnings.py")][:-1]
                site = _site(stack, self.root)
                self.sites[site] += 1
                self.waits.append((site, stack))
            else:
                self._show(message, category, filename, lineno, file, line)

        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        import torch

        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = self._show
        self._catch.__exit__(*exc)

    @property
    def count(self) -> int:
        return sum(self.sites.values())
