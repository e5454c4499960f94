"""Process-group start-up: gloo on CPU, nccl on GPU, always with a timeout."""

from __future__ import annotations

import logging
import os
import socket
from datetime import timedelta

import torch

from openppo.distributed.rendezvous import group_store

logger = logging.getLogger(__name__)

if not torch.cuda.is_available():
    # Tell DeepSpeed up front instead of letting it probe and warn in every process.
    os.environ.setdefault("DS_ACCELERATOR", "cpu")


def free_port() -> int:
    """A TCP port unused on localhost right now (racy by nature: what binds it later may find it taken, so a group
    that meets across processes meets on a store served first, `openppo.distributed.rendezvous`)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_launcher_env() -> None:
    """Fill the torch.distributed env for a plain `python -m` run (world size 1).

    Without these DeepSpeed falls back to MPI discovery, which is absent here. Nothing binds MASTER_PORT in a world of
    one: its group meets on an in-process store (`rendezvous.group_store`).
    """
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        os.environ.setdefault("LOCAL_RANK", os.environ["RANK"])
        return
    os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))


def _disable_cpu_shm_comm() -> None:
    """Stop DeepSpeed from JIT-building its shared-memory all-reduce op on CPU.

    DeepSpeed 0.19 builds `deepspeed_shm_comm` inside every CPU `init_distributed` (60-160 s on 2 cores). It only
    speeds up large intra-node CPU all-reduces, which CPU runs here do not need; `OPENPPO_DS_SHM_COMM=1` keeps it.
    """
    if os.environ.get("OPENPPO_DS_SHM_COMM") == "1":
        return
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def _cpu_thread_budget() -> None:
    """Split the cores between the ranks on this host: oversubscribed CPU ranks run several times slower."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, local_world)))


def init_distributed(timeout_s: int) -> tuple[int, int]:
    """Start the default process group (once) and return (rank, world_size)."""
    import deepspeed

    ensure_launcher_env()
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    else:
        _disable_cpu_shm_comm()
        _cpu_thread_budget()
    if not torch.distributed.is_initialized():
        backend, timeout = "nccl" if on_gpu else "gloo", timedelta(seconds=timeout_s)
        store = group_store(timeout_s)
        if store is not None:  # a WorkerGroup's rank or a world of one: DeepSpeed adopts the group
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            # bound to its GPU as DeepSpeed's own start-up binds it (NCCL then knows each rank's device up front)
            device = {"device_id": torch.device("cuda", torch.cuda.current_device())} if on_gpu and world > 1 else {}
            torch.distributed.init_process_group(
                backend, store=store, rank=rank, world_size=world, timeout=timeout, **device
            )
        deepspeed.init_distributed(dist_backend=backend, timeout=timeout, verbose=False)
    return torch.distributed.get_rank(), torch.distributed.get_world_size()
