"""Where a process group's ranks meet (`openppo.distributed.rendezvous`): a world of one binds no port."""

from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from openppo.distributed.rendezvous import STORE_ENV, group_store


def test_a_world_of_one_meets_on_a_store_in_its_process(monkeypatch):
    """A plain `python -m` run (world size 1) took `env://`, which binds a MASTER_PORT probed free earlier: CI failed
    with EADDRINUSE when another process took it in between. Here MASTER_PORT is held by someone else all along."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.delenv(STORE_ENV, raising=False)
        for key, value in dict(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1").items():
            monkeypatch.setenv(key, value)
        monkeypatch.setenv("MASTER_PORT", str(taken.getsockname()[1]))
        store = group_store(timeout_s=10)
        assert store is not None
        # a group on it works (not the default group: other tests in this process may hold one)
        group = dist.ProcessGroupGloo(store, 0, 1, timedelta(seconds=10))
        t = torch.ones(3)
        group.allreduce([t]).wait()
        assert torch.equal(t, torch.ones(3))


def test_a_world_of_two_without_a_served_store_keeps_env_rendezvous(monkeypatch):
    """torchrun's ranks (no openppo store): start-up stays `env://`, on torchrun's own store."""
    monkeypatch.delenv(STORE_ENV, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert group_store(timeout_s=10) is None
