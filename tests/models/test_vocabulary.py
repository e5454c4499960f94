"""`vocabulary_difference` on real tokenizers: the suite's Qwen3-8k one, SmolLM2's, and edited copies."""

from __future__ import annotations

import json

import pytest

from openppo.models.hf import load_tokenizer, vocabulary_difference
from tests.model_cache import smollm2_dir, tiny_model_dir


@pytest.fixture(scope="module")
def qwen():
    return load_tokenizer(str(tiny_model_dir()))


def test_the_same_vocabulary_in_two_model_folders_agrees(qwen):
    # two tiny models of different architectures built on the one tokenizer
    assert vocabulary_difference(qwen, load_tokenizer(str(tiny_model_dir(arch="llama")))) is None


def test_another_family_differs_in_size(qwen):
    smol = load_tokenizer(str(smollm2_dir()))
    assert vocabulary_difference(qwen, smol) == f"{len(smol.get_vocab())} tokens against {len(qwen.get_vocab())}"


def test_an_added_token_a_swapped_id_or_another_end_token_is_a_difference(qwen, tmp_path):
    other = load_tokenizer(str(tiny_model_dir()))
    other.add_tokens(["<teacher-only>"])
    assert vocabulary_difference(qwen, other) == f"{len(other.get_vocab())} tokens against {len(qwen.get_vocab())}"

    # same size, two ids read the other way round: a copy of the tokenizer whose vocabulary swaps ids 100 and 101
    folder = tmp_path / "swapped"
    qwen.save_pretrained(folder)
    spec = json.loads((folder / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = (next(t for t, i in vocab.items() if i == n) for n in (100, 101))
    vocab[a], vocab[b] = 101, 100
    (folder / "tokenizer.json").write_text(json.dumps(spec))
    swapped = load_tokenizer(str(folder))
    assert swapped.convert_ids_to_tokens(100) == b == qwen.convert_ids_to_tokens(101)
    assert vocabulary_difference(qwen, swapped) == f"token id 100 is {b!r} there and {a!r} here"
    other = load_tokenizer(str(tiny_model_dir()))
    other.eos_token = qwen.convert_ids_to_tokens(0)
    assert vocabulary_difference(qwen, other) == f"end-of-sequence id 0 there and {qwen.eos_token_id} here"
