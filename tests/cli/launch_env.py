"""A rank that writes the environment it was launched with to `<folder>/rank<RANK>.json`, after meeting the other
ranks on torch's `env://` start-up and summing their ranks (tests/cli/test_launchers.py: the preloaded server's
ranks against torchrun's). A file per rank, not stdout: unbuffered ranks print a line in two writes, and two
ranks' lines interleave on a shared pipe."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

if __name__ == "__main__":
    dist.init_process_group("gloo")
    total = torch.tensor([dist.get_rank()])
    dist.all_reduce(total)
    record = {"sum": int(total), "env": dict(os.environ)}
    (Path(sys.argv[1]) / f"rank{os.environ['RANK']}.json").write_text(json.dumps(record))
    dist.destroy_process_group()
