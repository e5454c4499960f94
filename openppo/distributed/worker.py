"""The base class of every process a `WorkerGroup` starts (one Ray actor per rank).

A worker reads its place in the group from the torch.distributed variables the group set for it (RANK,
WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), logs with a `[group rankN]` prefix, and keeps its last log
lines in memory so the driver can show them when something goes wrong. Subclasses add the real work (a DeepSpeed
engine, a reward model...) and must call `super().__init__()`.

torch, DeepSpeed and Ray are imported only when used: a light worker starts in about a second, and a model worker
runs in-process where Ray is not installed (the GPU check suite).
"""

from __future__ import annotations

import collections
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

# Env var carrying the group's name into its workers (for log prefixes and error messages).
GROUP_NAME_ENV = "OPENPPO_WORKER_GROUP"
_LOG_RING_LINES = 500


class _RingHandler(logging.Handler):
    """Keeps the last formatted log lines of this process."""

    def __init__(self, capacity: int):
        super().__init__(level=logging.INFO)
        self.lines: collections.deque[str] = collections.deque(maxlen=capacity)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.lines.extend(self.format(record).splitlines())
        except Exception:  # logging must never take the worker down
            self.handleError(record)


def _setup_worker_logging(group: str, rank: int) -> _RingHandler:
    """Rank-prefixed logging: every rank keeps INFO in its ring buffer; only rank 0 prints INFO to stdout."""
    from openppo.utils.tracking import setup_logging

    setup_logging(rank)  # format, quiet libraries; then re-prefix and open the root logger to INFO for the ring
    formatter = logging.Formatter(
        f"%(asctime)s [{group} rank{rank}] %(levelname).1s %(name)s: %(message)s", datefmt="%H:%M:%S"
    )
    root = logging.getLogger()
    for handler in root.handlers:
        handler.setFormatter(formatter)
        handler.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    root.setLevel(logging.INFO)
    ring = _RingHandler(_LOG_RING_LINES)
    ring.setFormatter(formatter)
    root.addHandler(ring)
    return ring


class BaseWorker:
    """Rank bookkeeping, logging and the small remote helpers a `WorkerGroup` relies on."""

    def __init__(self) -> None:
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.group_name = os.environ.get(GROUP_NAME_ENV, type(self).__name__)
        # Set up at the group's first call (`ping`), not here: a worker built in-process (tests) keeps the host
        # process's logging as it is.
        self._log_ring: _RingHandler | None = None
        self._profiler: Any = None  # a StepProfiler while a --profile_steps step is traced

    # --------------------------------------------------------------------------------------- remote helpers
    def node_ip(self) -> str:
        import ray

        return ray.util.get_node_ip_address()

    def serve_rendezvous(self, master_addr: str, timeout_s: float) -> int:
        """Rank 0: serve the group's store on a port the OS picks, held until the process group starts on it
        (`rendezvous.group_store`); returns the port the other ranks connect to."""
        from openppo.distributed.rendezvous import hold_store

        return hold_store(master_addr, self.world_size, timeout_s)

    def ping(self) -> dict[str, Any]:
        """Where this worker runs: answers once the constructor has finished. The group's first call: from here on
        the rank logs with its `[group rankN]` prefix and keeps its last lines."""
        from openppo.distributed.logs import actor_location

        if self._log_ring is None:
            self._log_ring = _setup_worker_logging(self.group_name, self.rank)
        return {"rank": self.rank, **actor_location(), "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}

    def last_log_lines(self, n: int = 20) -> list[str]:
        """The last `n` lines this process logged through `logging` (every level from INFO, on every rank)."""
        lines = self._log_ring.lines if self._log_ring is not None else []
        return list(lines)[-n:] if n > 0 else []

    def set_dist_env(self, env: dict[str, str]) -> None:
        """Called by the group once rank 0's address and port are known, before any user method runs."""
        os.environ.update({k: str(v) for k, v in env.items()})
        self.rank = int(os.environ.get("RANK", self.rank))
        self.world_size = int(os.environ.get("WORLD_SIZE", self.world_size))
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.local_rank))

    def get_env(self, names: list[str]) -> dict[str, str | None]:
        return {name: os.environ.get(name) for name in names}

    def start_profile(self) -> None:
        """--profile_steps: record this rank's torch activity until `stop_profile`."""
        from openppo.utils.profiling import StepProfiler

        self._profiler = StepProfiler()
        self._profiler.start()

    def stop_profile(self, out_dir: str) -> str | None:
        """Write this rank's trace as `<out_dir>/<group>_rank<N>.json`; returns the path."""
        if self._profiler is None:
            return None
        profiler, self._profiler = self._profiler, None
        return profiler.stop(f"{out_dir}/{self.group_name}_rank{self.rank}.json")
