"""One Ray cluster for the whole test session, started on first use and stopped when the session ends.

Every `train_ppo_ray` run and engine fixture joins it (`RAY_ADDRESS`, the path `ray job submit` takes) instead of
starting and stopping a cluster of its own: a local cluster costs 7.5 s wall and 8.8 CPU-seconds per run on a 2-core
box (its GCS, raylet, dashboard and runtime-env agents, 2 prestarted workers), joining one 1.2 s and 1.4.

It is a one-node CPU cluster of this machine with the slots a run would give itself (`launch.local_cpu_slots`), so a
run decides devices, threads and placement as it would alone. Tests that need their own cluster keep starting it:
fake GPUs (a run joining a cluster with GPUs would take the GPU path), or a killed run whose every process must carry
the run's environment tag (tests/processes.py), which only processes its own driver started do.
"""

from __future__ import annotations

import os

_cluster = None
_zygotes = None


def address() -> str:
    """The session cluster's address (started here on the first call)."""
    global _cluster, _zygotes
    if _cluster is None:
        from ray.cluster_utils import Cluster

        from openppo.ppo.launch import local_cpu_slots
        from tests.cli.helpers import cli_env

        saved = dict(os.environ)
        # the processes Ray starts get what the CLI runs' drivers get: a local cluster inherits it from its driver, a
        # joined one from whoever started it
        env = cli_env()
        os.environ.clear()
        os.environ.update(env)
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        # Ray's log monitor globs the session's log folder on every 0.1 s pass while it holds under 1000 files, and
        # this cluster's folder gathers every test's workers (213 files seen): 0 makes it glob every 0.5 s, Ray's own
        # rule for big folders (a monitor of 200 idle files: 0.39 -> 0.17 CPU-s per 40 s, docs/benchmarks.md)
        os.environ.setdefault("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD", "0")
        # Ray's workers, and the engine actors' vLLM processes, fork from Pythons that imported what they import
        # (tests/engine_zygote)
        from tests.engine_zygote import for_cluster

        _zygotes = for_cluster(dict(os.environ))
        if _zygotes is not None:
            os.environ.clear()
            os.environ.update(_zygotes.env)
        try:
            _cluster = Cluster(
                initialize_head=True,
                head_node_args={
                    "num_cpus": local_cpu_slots(),
                    "num_gpus": 0,
                    "include_dashboard": False,
                    "object_store_memory": 1 << 30,
                },
            )
        finally:
            os.environ.clear()
            os.environ.update(saved)
    return _cluster.address


def shutdown() -> None:
    global _cluster, _zygotes
    if _cluster is not None:
        _cluster.shutdown()
        _cluster = None
    if _zygotes is not None:
        _zygotes.close()
        _zygotes = None


def ray_worker_zygote_pid() -> int | None:
    """The pid of the zygote of the session cluster's Ray workers (tests/engine_zygote), if it has one."""
    return _zygotes.ray_worker.proc.pid if _zygotes is not None and _zygotes.ray_worker is not None else None


def engine_zygote_pid() -> int | None:
    """The pid of the zygote of the session cluster's vLLM processes (tests/engine_zygote), if it has one."""
    return _zygotes.engine.proc.pid if _zygotes is not None else None


def connect() -> None:
    """Join the session cluster from this process (`ray.shutdown()` leaves it; the cluster goes on)."""
    import ray

    ray.init(address=address(), logging_level="warning")
