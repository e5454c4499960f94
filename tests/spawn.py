"""Run a function on N spawned gloo ranks and collect what each rank wrote (tests of collectives on CPU).

`worker(rank, out_dir, port)` must write `<out_dir>/rank<rank>.json`; `run_ranks` returns those dicts in rank order,
or fails the test with the worker's traceback, or after `timeout_s` (a mismatched collective hangs otherwise).

The test process serves the ranks' TCPStore on a port the OS picked and keeps it until they end, and every rank joins
it as a client (`rendezvous.STORE_ENV`, as a WorkerGroup's ranks do): a port probed free and bound later by rank 0 was
taken in between once in CI (EADDRINUSE) while the other test worker ran Ray jobs.

The ranks are forked from multiprocessing's fork server, which this test worker starts once with the libraries every
rank imports already imported (`PRELOAD`): a spawned rank spent 8-10 of its CPU-seconds importing torch, DeepSpeed,
transformers and openppo, and the suite starts dozens of them on a 2-core box. The server is a fresh interpreter
(not a fork of the test worker and its threads), started from the environment the session began with; each rank
then takes the environment `run_ranks` was called with, as a spawned one would. What the preloaded libraries read
from the environment as they load is read in the server, from the session's environment; a module that reads a
test's own variable as it loads stays out of `PRELOAD` (DeepSpeed's Muon module: test_muon sets TORCHDYNAMO_DISABLE).
"""

from __future__ import annotations

import gc
import json
import multiprocessing.forkserver
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from openppo.distributed.rendezvous import STORE_ENV, serve_store

# Imported once by the fork server: the training ranks' libraries (a torch.compile decorator reads
# TORCHDYNAMO_DISABLE as it decorates: DeepSpeed's Muon module, which test_muon runs eagerly, is not among them)
PRELOAD = ("deepspeed", "openppo.strategy.distributed", "openppo.ppo.workers")
_SESSION_ENV = dict(os.environ)  # as the test session began (conftest's defaults set)


def _fork_server() -> None:
    """Start the fork server unless it runs, from the session's environment (a test's own variables stay its own)."""
    mp.set_forkserver_preload(list(PRELOAD))
    during = dict(os.environ)
    os.environ.clear()
    os.environ.update(_SESSION_ENV)
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        os.environ.clear()
        os.environ.update(during)


def _joining_rank(
    rank: int, worker: Callable[[int, str, int], None], out_dir: str, port: int, env: dict[str, str]
) -> None:
    gc.freeze()  # what the fork server imported: this rank's collections skip it (see tests/engine_zygote's zygotes)
    os.environ.clear()
    os.environ.update(env)  # the caller's, as a spawned rank inherits it
    os.environ[STORE_ENV] = "1"  # openppo's init_distributed then joins the store at MASTER_PORT as a client
    worker(rank, out_dir, port)


def run_ranks(
    worker: Callable[[int, str, int], None], world: int, out_dir: Path, timeout_s: float, what: str
) -> list[dict]:
    _fork_server()
    store = serve_store("127.0.0.1", 0, world, timeout_s)
    args = (worker, str(out_dir), store.port, dict(os.environ))
    procs = mp.start_processes(_joining_rank, args=args, nprocs=world, start_method="forkserver", join=False)
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
