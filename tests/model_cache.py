"""Models shared by the whole test suite, built once per cache folder and reused across sessions.

Import from any test package: `from tests.model_cache import tiny_model_dir, smollm2_dir`. The cache folder is
`$OPENPPO_TEST_CACHE` if set, else `<repo>/.cache/test-models` (git-ignored). Builds are locked and atomic
(see `openppo.models.zoo`), so concurrent test processes may ask for the same model.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def cache_dir() -> Path:
    return Path(os.environ.get("OPENPPO_TEST_CACHE") or REPO / ".cache" / "test-models")


def tiny_model_dir(**kwargs) -> Path:
    """`<cache>/tiny-qwen2` for the defaults; other `build_tiny_model` keyword arguments get their own folder."""
    from openppo.models.zoo import build_tiny_model

    name = "tiny-qwen2" if not kwargs else "tiny-" + "-".join(f"{k}{v}" for k, v in sorted(kwargs.items()))
    return build_tiny_model(cache_dir() / name, **kwargs)


def smollm2_dir() -> Path:
    """`<cache>/smollm2`: SmolLM2-135M-Instruct in bf16 (~40 s the first time, then instant)."""
    from openppo.models.zoo import materialize_smollm2

    return materialize_smollm2(cache_dir() / "smollm2")
