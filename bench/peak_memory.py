"""What a GPU step's peak memory holds: the allocations alive at the step's peak, by the line that made them.

`torch.cuda.memory._record_memory_history` records every allocation and free of the caching allocator with the
Python stack of the allocation; `peak_breakdown` replays one step's record: the bytes alive before it (weights,
gradients, optimizer states: allocated before the record began) plus each allocation, less each free, up to the
largest total, and sums what is alive there by the innermost frame in the project, transformers, DeepSpeed or
Liger (`SITE_PACKAGES`). Block sizes are the allocator's, as `torch.cuda.max_memory_allocated` counts them, so the
replayed peak can be checked against it. For the memory planner (`openppo.ppo.memory_plan`): which of its terms a
measured peak is made of.
"""

from __future__ import annotations

from collections import Counter

GIB = 2**30
SITE_PACKAGES = ("/openppo/", "/bench/", "/transformers/", "/deepspeed/", "/liger_kernel/")
BEFORE = "alive before the step (weights, gradients, optimizer states)"


def allocation_site(frames: list[dict]) -> str:
    """The innermost frame (frames are innermost first) of the project or of the libraries it drives, as
    "path:line (function)" from the package down; the innermost frame of all when none is."""
    if not frames:
        return "(no stack recorded)"
    for frame in frames:
        name = frame.get("filename", "")
        for package in SITE_PACKAGES:
            if package in name:
                short = package.strip("/") + "/" + name.split(package, 1)[1]
                return f"{short}:{frame.get('line')} ({frame.get('name')})"
    frame = frames[0]
    return f"{frame.get('filename', '?').rsplit('/', 1)[-1]}:{frame.get('line')} ({frame.get('name')})"


def peak_breakdown(trace: list[dict], start_bytes: int, top: int = 12) -> dict:
    """The peak of `trace` (one device's `device_traces` entries of a memory snapshot, in order) over `start_bytes`
    alive before it, in GiB, and what is alive there: the pre-existing bytes not yet freed, and the trace's
    allocations by `allocation_site`, the `top` largest."""
    live = peak = start_bytes
    peak_at = -1  # the entry after which the total is largest (-1: before the trace)
    sizes: dict[int, int] = {}
    for i, event in enumerate(trace):
        action, addr, size = event.get("action"), event.get("addr"), int(event.get("size", 0))
        if action == "alloc":
            sizes[addr] = size
            live += size
        elif action == "free_completed":
            sizes.pop(addr, None)
            live -= size
        if live > peak:
            peak, peak_at = live, i
    alive: dict[int, tuple[int, str]] = {}
    before = start_bytes
    for event in trace[: peak_at + 1]:
        action, addr, size = event.get("action"), event.get("addr"), int(event.get("size", 0))
        if action == "alloc":
            alive[addr] = (size, allocation_site(event.get("frames", [])))
        elif action == "free_completed" and alive.pop(addr, None) is None:
            before -= size  # allocated before the trace began
    sites: Counter[str] = Counter()
    for size, site in alive.values():
        sites[site] += size
    return {
        "peak_gib": round(peak / GIB, 3),
        "by_site_gib": {BEFORE: round(before / GIB, 3)}
        | {site: round(size / GIB, 3) for site, size in sites.most_common(top)},
        "other_sites_gib": round(sum(size for _, size in sites.most_common()[top:]) / GIB, 3),
    }
