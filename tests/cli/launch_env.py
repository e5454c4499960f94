"""A rank that prints the environment it was launched with, after meeting the other ranks on torch's `env://`
start-up and summing their ranks (tests/cli/test_launchers.py: the preloaded server's ranks against torchrun's)."""

from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist

if __name__ == "__main__":
    dist.init_process_group("gloo")
    total = torch.tensor([dist.get_rank()])
    dist.all_reduce(total)
    print(json.dumps({"sum": int(total), "env": dict(os.environ)}), flush=True)
    dist.destroy_process_group()
