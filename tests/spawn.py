"""Run a function on N spawned gloo ranks and collect what each rank wrote (tests of collectives on CPU).

`worker(rank, out_dir, port)` must write `<out_dir>/rank<rank>.json`; `run_ranks` returns those dicts in rank order,
or fails the test with the worker's traceback, or after `timeout_s` (a mismatched collective hangs otherwise).
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(
    worker: Callable[[int, str, int], None], world: int, out_dir: Path, timeout_s: float, what: str
) -> list[dict]:
    procs = mp.start_processes(worker, args=(str(out_dir), free_port()), nprocs=world, start_method="spawn", join=False)
    deadline = time.monotonic() + timeout_s
    try:
        while not procs.join(timeout=1):  # raises with the worker's traceback if one failed
            if time.monotonic() > deadline:
                pytest.fail(f"{what} workers still running after {timeout_s} s (a mismatched collective?)")
    finally:
        for p in procs.processes:
            if p.is_alive():
                p.terminate()
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]
