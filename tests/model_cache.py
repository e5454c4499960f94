"""Shared, cached test models (built once per cache folder)."""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def cache_dir() -> Path:
    return Path(os.environ.get("OPENPPO_TEST_CACHE", REPO / ".cache" / "test-models"))


def tiny_model_dir(**kwargs) -> Path:
    from openppo.models.zoo import build_tiny_model

    name = "tiny-" + "-".join(f"{k}{v}" for k, v in sorted(kwargs.items())) if kwargs else "tiny-qwen2"
    return build_tiny_model(cache_dir() / name, **kwargs)


def smollm2_dir() -> Path:
    from openppo.models.zoo import materialize_smollm2

    return materialize_smollm2(cache_dir() / "smollm2")
