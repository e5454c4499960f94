"""Suite-wide settings: offline hubs, repo-local JIT cache, markers."""

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: runs a real multi-process CLI job (tens of seconds)")
    config.addinivalue_line("markers", "gpu: the GPU check suite (tests/gpu/; skipped without CUDA)")


def pytest_sessionfinish(session, exitstatus):
    from tests import ray_cluster

    ray_cluster.shutdown()
