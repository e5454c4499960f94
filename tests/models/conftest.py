"""Session fixtures for the model-zoo tests; the same models as `tests.model_cache` (shared on-disk cache)."""

from pathlib import Path

import pytest

from tests import model_cache


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    return model_cache.tiny_model_dir()


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    return model_cache.smollm2_dir()
