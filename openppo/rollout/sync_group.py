"""A dedicated process group for trainer -> rollout engine weight transfer.

The group joins trainer rank 0 (group rank 0, the only sender) with every worker of every vLLM engine. It is built
from a standalone `TCPStore` (served by rank 0) and a backend object used directly -- `ProcessGroupGloo` on CPU,
`ProcessGroupNCCL` on GPU -- and is never registered with `torch.distributed`: the trainer's DeepSpeed group and
vLLM's own groups stay untouched, and either side may already have a default group or not.

Every blocking step is bounded by `timeout_s`: the store connection, the rendezvous inside the backend
constructor, and each broadcast (a peer that never shows up raises instead of hanging).
"""

from __future__ import annotations

import logging
from datetime import timedelta

import torch
import torch.distributed as dist

from openppo.distributed.rendezvous import join_store, serve_store
from openppo.errors import UserError

logger = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")


class SyncGroup:
    """A standalone process group: rank 0 broadcasts, every other rank receives."""

    def __init__(self, backend: str, store: dist.Store, pg, rank: int, world_size: int, timeout_s: float):
        self.backend = backend
        self.rank = rank
        self.world_size = world_size
        self.timeout = timedelta(seconds=timeout_s)
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self._store = store
        self._pg = pg

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Broadcast `tensor` in place from group rank `src`; waits at most the group's timeout."""
        assert self._pg is not None, "the sync group was destroyed"
        assert tensor.device.type == self.device.type, (
            f"{self.backend} sync group needs {self.device.type} tensors, got {tensor.device}"
        )
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        work = self._pg.broadcast([tensor], opts)
        if self.backend == "gloo":
            work.wait(self.timeout)
        else:
            # NCCL: wait() orders the current stream after the collective (the timeout is the watchdog's);
            # synchronize so the caller may reuse or free the buffer as soon as this returns.
            work.wait()
            torch.cuda.current_stream().synchronize()
        return tensor

    def barrier(self) -> None:
        """All ranks meet (a one-element broadcast: works the same on both backends)."""
        flag = torch.zeros(1, dtype=torch.uint8, device=self.device)
        self.broadcast(flag, src=0)

    def destroy(self) -> None:
        """Release the backend and the store; the group cannot be used afterwards."""
        pg, self._pg = self._pg, None
        if pg is not None and hasattr(pg, "shutdown"):
            try:
                pg.shutdown()
            except Exception as exc:  # shutdown is best effort: the peers may be gone already
                logger.debug("sync group shutdown: %s", exc)
        self._store = None


def create_sync_group(
    backend: str,
    master_addr: str,
    master_port: int,
    rank: int,
    world_size: int,
    timeout_s: float,
    store: dist.TCPStore | None = None,
) -> SyncGroup:
    """Join the weight-sync group as `rank` of `world_size`; rank 0 serves the store on `master_addr:master_port`
    (or passes the one `serve_store` already opened, whose port it told the others).

    Every rank must call this within `timeout_s` of the others: the call returns once all have joined. Rank 0 is
    the trainer (the sender); engine workers take ranks 1..world_size-1.
    """
    if backend not in BACKENDS:
        raise UserError(f"weight sync backend {backend!r} is not supported: pass one of {', '.join(BACKENDS)}")
    assert 0 <= rank < world_size, f"rank {rank} outside world of {world_size}"
    timeout = timedelta(seconds=timeout_s)
    if backend == "nccl" and not torch.cuda.is_available():
        raise UserError(
            "the nccl weight sync backend needs a CUDA GPU in every process of the group; use the gloo backend on CPU"
        )
    if store is None and rank == 0:
        store = serve_store(master_addr, master_port, world_size, timeout_s)
    elif store is None:
        store = join_store(master_addr, master_port, world_size, timeout_s)
    # A prefix keeps our keys apart should the same store ever serve something else.
    prefixed = dist.PrefixStore(f"openppo_weight_sync/{backend}/", store)
    if backend == "gloo":
        pg = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    else:
        pg = _nccl_group(prefixed, rank, world_size, timeout)
    logger.info("weight sync group ready: %s rank %d/%d via %s:%d", backend, rank, world_size, master_addr, master_port)
    return SyncGroup(backend, store, pg, rank, world_size, timeout_s)


def _nccl_group(store: dist.Store, rank: int, world_size: int, timeout: timedelta):
    """A `ProcessGroupNCCL` bound to the current CUDA device, built the way torch builds a subgroup's backend."""
    if not dist.is_nccl_available():
        raise UserError("this torch build has no NCCL: install a CUDA build of torch or use the gloo backend")
    from torch.distributed import ProcessGroupNCCL

    options = ProcessGroupNCCL.Options()
    options.is_high_priority_stream = False
    options._timeout = timeout
    if hasattr(options, "group_name"):
        options.group_name = "openppo_weight_sync"  # shows in NCCL watchdog / flight-recorder messages
    pg = ProcessGroupNCCL(store, rank, world_size, options)
    # Connect now, on this device: the rendezvous then happens inside create_sync_group (bounded by the
    # store timeout) rather than lazily inside the first broadcast.
    device = torch.device("cuda", torch.cuda.current_device())
    if hasattr(pg, "eager_connect_single_device"):
        pg.eager_connect_single_device(device)
    return pg
