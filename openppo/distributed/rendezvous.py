"""Where the ranks of a process group meet: rank 0's TCPStore, listening before any rank is told its port.

Port 0 makes the OS pick a free port and keeps it bound from then on. Probing a port free and binding it later (as
`env://` start-up does with a MASTER_PORT chosen earlier) leaves a window in which another process can take it: an
outgoing connection's ephemeral port on a busy node, or another run's rendezvous. That failed runs with EADDRINUSE
when two runs shared a 2-core box. So rank 0 serves the store first and sends its port; every rank then builds its
process group on a store passed in (`torch.distributed.init_process_group(store=...)`), rank 0 on the one it holds.
A group of one process (a plain `python -m openppo.cli...` run) needs no port at all: its store lives in the process.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch.distributed as dist

# Set (to "1") in the environment of every rank of a group whose rank 0 serves its store (`WorkerGroup`): the ranks
# then join that store instead of an `env://` rendezvous, which would try to bind MASTER_PORT again on rank 0.
STORE_ENV = "OPENPPO_RENDEZVOUS_STORE"

_held: dist.TCPStore | None = None  # the store this process serves for its group (rank 0), until the group is up


def serve_store(master_addr: str, master_port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's store on `master_port` (0: one the OS picks; read it back as `.port`), listening from now on."""
    return dist.TCPStore(
        master_addr,
        master_port,
        world_size,
        is_master=True,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def join_store(master_addr: str, master_port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """Another rank's connection to rank 0's store (waits at most `timeout_s` for it)."""
    return dist.TCPStore(master_addr, master_port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s))


def hold_store(master_addr: str, world_size: int, timeout_s: float) -> int:
    """Rank 0 of a group: serve the group's store in this process until `group_store` takes it; returns its port."""
    global _held
    _held = serve_store(master_addr, 0, world_size, timeout_s)
    return _held.port


def group_store(timeout_s: float) -> dist.Store | None:
    """This rank's store for its default process group: the one it holds (rank 0), a connection to MASTER_ADDR and
    MASTER_PORT (the other ranks), an in-process store (a world of one), or None where the group's rank 0 serves
    none (`env://` start-up, as torchrun's)."""
    global _held
    if os.environ.get(STORE_ENV) != "1":
        # A world of one meets nobody: `env://` would bind a MASTER_PORT probed free earlier, which another process
        # can take in between (CI failed so once: EADDRINUSE while the other test worker ran Ray jobs).
        return dist.HashStore() if os.environ.get("WORLD_SIZE") == "1" else None
    if _held is not None:
        store, _held = _held, None
        return store
    world_size = int(os.environ["WORLD_SIZE"])
    return join_store(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, timeout_s)
