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


# The suite's tiny models speak Qwen3's tokenizer cut to its first 8192 tokens: at the full 151,669 the vocabulary
# is ~96 % of a tiny model's compute and the suite ran 1.45x as long (docs/benchmarks.md, "Test suite").
TOKENIZER = "qwen3-8k"


def tiny_model_dir(**kwargs) -> Path:
    """`<cache>/tiny-qwen2-8k` for the defaults; other `build_tiny_model` keyword arguments get their own folder."""
    from openppo.models.zoo import build_tiny_model

    name = "tiny-qwen2-8k" if not kwargs else "tiny-8k-" + "-".join(f"{k}{v}" for k, v in sorted(kwargs.items()))
    return build_tiny_model(cache_dir() / name, **{"tokenizer": TOKENIZER, **kwargs})


def tiny_vlm_dir(**kwargs) -> Path:
    """`<cache>/tiny-idefics3-8k` for the defaults: the tiny Idefics3 VLM with its processor (a few seconds)."""
    from openppo.models.tiny_vlm import build_tiny_vlm

    name = "tiny-idefics3-8k" + "".join(f"-{k}{v}" for k, v in sorted(kwargs.items()))
    return build_tiny_vlm(cache_dir() / name, **{"tokenizer": TOKENIZER, **kwargs})


def smollm2_dir() -> Path:
    """`<cache>/smollm2`: SmolLM2-135M-Instruct in bf16 (~40 s the first time, then instant)."""
    from openppo.models.zoo import materialize_smollm2

    return materialize_smollm2(cache_dir() / "smollm2")


def favoured_word_model_dir(word: str = " world", scale: float = 2.5) -> Path:
    """The default tiny model edited so that it already says `word` (one token) in many positions.

    For tests where the reward must rise: a random tiny model never says the target word, so a "say the word"
    reward would never fire (`openppo.models.zoo.favour_tokens`). Cached like the other test models.
    """
    from openppo.models.zoo import _cached_build, favour_tokens

    base = tiny_model_dir()
    out = cache_dir() / f"tiny-qwen2-8k-favour{word.strip()}-{scale:g}"

    def make(tmp: Path) -> dict:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(base)
        ids = tok.encode(word, add_special_tokens=False)
        assert len(ids) == 1, f"{word!r} is {len(ids)} tokens; pick a one-token word"
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
        favour_tokens(model, ids, scale)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        return {"token_id": ids[0]}

    return _cached_build(out, {"kind": "favoured-word", "base": str(base), "word": word, "scale": scale}, make)
