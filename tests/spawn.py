"""Run a function on N spawned gloo ranks and collect what each rank wrote (tests of collectives on CPU).

`worker(rank, out_dir, port)` must write `<out_dir>/rank<rank>.json`; `run_ranks` returns those dicts in rank order,
or fails the test with the worker's traceback, or after `timeout_s` (a mismatched collective hangs otherwise).

The test process serves the ranks' TCPStore on a port the OS picked and keeps it until they end, and every rank joins
it as a client (`rendezvous.STORE_ENV`, as a WorkerGroup's ranks do): a port probed free and bound later by rank 0 was
taken in between once in CI (EADDRINUSE) while the other test worker ran Ray jobs.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from openppo.distributed.rendezvous import STORE_ENV, serve_store


def _joining_rank(rank: int, worker: Callable[[int, str, int], None], out_dir: str, port: int) -> None:
    os.environ[STORE_ENV] = "1"  # openppo's init_distributed then joins the store at MASTER_PORT as a client
    worker(rank, out_dir, port)


def run_ranks(
    worker: Callable[[int, str, int], None], world: int, out_dir: Path, timeout_s: float, what: str
) -> list[dict]:
    store = serve_store("127.0.0.1", 0, world, timeout_s)
    procs = mp.start_processes(
        _joining_rank, args=(worker, str(out_dir), store.port), nprocs=world, start_method="spawn", join=False
    )
    deadline = time.monotonic() + timeout_s
    try:
        while not procs.join(timeout=1):  # raises with the worker's traceback if one failed
            if time.monotonic() > deadline:
                pytest.fail(f"{what} workers still running after {timeout_s} s (a mismatched collective?)")
    finally:
        for p in procs.processes:
            if p.is_alive():
                p.terminate()
        del store  # closes the port once no rank needs it
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]
