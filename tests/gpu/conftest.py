"""Fixtures of the GPU check suite (`tests/gpu/`, marker `gpu`): one process as a single DeepSpeed rank on the GPU,
and a small random model. Every module skips itself without CUDA, so the CPU suite only checks that it imports.
The whole suite and the GPU benches run in one command: `bash tests/gpu/run.sh`."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="GPU check suite: needs a CUDA GPU")


@pytest.fixture
def single_rank(monkeypatch):
    """This process as rank 0 of a world of 1 (its group meets on a store inside the process; MASTER_PORT is only
    set because DeepSpeed reads it)."""
    from openppo.strategy.distributed import free_port

    for key, value in {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": os.environ.get("MASTER_PORT") or str(free_port()),
    }.items():
        monkeypatch.setenv(key, value)


@pytest.fixture(scope="session")
def gpu_model_dir() -> Path:
    """A 4-layer Qwen2 of hidden 256 (head_dim 64: a flash-attention size) on the Qwen3 tokenizer, random, fp32."""
    from tests.model_cache import tiny_model_dir

    return tiny_model_dir(num_layers=4, hidden_size=256, num_heads=4, intermediate_size=512)
