"""The standalone gloo sync group: broadcast, bounded waits, no global registration (ranks as threads, fast)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from openppo.distributed.rendezvous import serve_store
from openppo.errors import UserError
from openppo.rollout.sync_group import create_sync_group


def _run_ranks(world_size: int, fn, timeout_s: float = 30.0) -> list:
    """Run fn(rank, port, store) in one thread per rank; return the results, re-raising the first error. `store` is
    rank 0's, served on a port the OS picked (None for the other ranks), as the trainer serves it."""
    store = serve_store("127.0.0.1", 0, world_size, timeout_s)
    results: list = [None] * world_size
    errors: list = []

    def target(rank: int) -> None:
        try:
            results[rank] = fn(rank, store.port, store if rank == 0 else None)
        except BaseException as exc:  # noqa: BLE001 -- handed to the test thread
            errors.append(exc)

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    if errors:
        raise errors[0]
    return results


def test_broadcast_reaches_every_rank_without_touching_the_default_group():
    payloads = [
        torch.arange(10, dtype=torch.float32),
        torch.randn(4, 3).to(torch.bfloat16),
        torch.randint(0, 255, (1000,), dtype=torch.uint8),
    ]

    def rank_fn(rank: int, port: int, store):
        group = create_sync_group("gloo", "127.0.0.1", port, rank, 3, timeout_s=20, store=store)
        got = []
        for p in payloads:
            buf = p.clone() if rank == 0 else torch.zeros_like(p)
            group.broadcast(buf, src=0)
            got.append(buf)
        group.barrier()
        group.destroy()
        return got

    # Other tests in this process may have started a default group; what matters is that ours adds nothing.
    def registered():
        return dist.is_initialized(), len(dist.distributed_c10d._world.pg_map)

    before = registered()
    for got in _run_ranks(3, rank_fn):
        assert all(torch.equal(a, b) for a, b in zip(got, payloads))
    assert registered() == before


def test_waits_are_bounded_by_the_timeout():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError):  # DistStoreError (a RuntimeError) or RuntimeError by step: must not hang
        create_sync_group("gloo", "127.0.0.1", 0, 0, 2, timeout_s=2)  # rank 0 alone, on a port the OS picks
    assert time.monotonic() - t0 < 15

    def rank_fn(rank: int, port: int, store):
        group = create_sync_group("gloo", "127.0.0.1", port, rank, 2, timeout_s=2, store=store)
        if rank == 0:  # rank 1 never posts its side of the broadcast
            t = time.monotonic()
            with pytest.raises(RuntimeError):  # gloo's timeout
                group.broadcast(torch.zeros(4), src=0)
            return time.monotonic() - t
        time.sleep(4)
        return None

    waited, _ = _run_ranks(2, rank_fn)
    print(f"broadcast gave up after {waited:.1f} s")
    assert waited < 3.5


def test_bad_backend_and_nccl_without_cuda_are_user_errors():
    with pytest.raises(UserError, match="gloo"):
        create_sync_group("mpi", "127.0.0.1", 1, 0, 1, timeout_s=1)
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="CUDA"):
            create_sync_group("nccl", "127.0.0.1", 1, 0, 1, timeout_s=1)


def test_rank_zero_listens_on_a_port_the_os_gave_it_before_anyone_hears_it():
    """`serve_store(port 0)` binds first and reports the port: nothing can take it between choosing it and using it
    (a probed-free port bound later was taken in between once, when two runs shared a box: EADDRINUSE). Every test
    here meets on such a store (`_run_ranks`)."""
    import socket

    store = serve_store("127.0.0.1", 0, 2, timeout_s=20)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe, pytest.raises(OSError):
        probe.bind(("127.0.0.1", store.port))
