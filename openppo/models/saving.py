"""Writing models as HF folders (full weights, or only the LoRA adapter for PEFT models)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import nn


def _inner(module: nn.Module) -> nn.Module:
    """The transformers/PEFT model inside our Actor/ScalarModel wrappers; a transformers or PEFT model itself as is
    (its own `.model` is its base model, without the head)."""
    from transformers import PreTrainedModel

    if isinstance(module, PreTrainedModel) or hasattr(module, "peft_config"):
        return module
    return getattr(module, "model", module)


def _strip_prefix(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


def save_hf_folder(
    module: nn.Module,
    state: dict[str, torch.Tensor] | None,
    tokenizer,
    out_dir: str | Path,
    extra_config: dict[str, Any] | None = None,
) -> None:
    """Save `module` (an Actor/ScalarModel wrapper or a bare HF model) to `out_dir`.

    `state` is the wrapper's full state dict (gathered from ZeRO-3 shards) or None to read it from the module.
    Files are written beside the target first, so a crash while serialising never leaves a truncated file.
    """
    out_dir = Path(out_dir)
    model = _inner(module)
    if state is None:
        state = {k: v.detach().cpu() for k, v in module.state_dict().items()}
    # Wrapper keys start with "model."; the HF model's own keys do not.
    if model is not module:
        state = _strip_prefix(state, "model.")
    config = model.get_base_model().config if hasattr(model, "get_base_model") else model.config
    for key, value in (extra_config or {}).items():
        setattr(config, key, value)
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if hasattr(model, "peft_config"):
        from peft import get_peft_model_state_dict

        adapter = get_peft_model_state_dict(model, state_dict=state)
        model.save_pretrained(tmp, state_dict=adapter)
        config.save_pretrained(tmp)  # the base config (with extras) beside the adapter
    else:
        model.save_pretrained(tmp, state_dict=state, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    # The save path also holds metrics, run info and checkpoints: move the model files in one by one
    # (each os.replace is atomic) instead of swapping the whole folder.
    out_dir.mkdir(parents=True, exist_ok=True)
    for item in tmp.iterdir():
        os.replace(item, out_dir / item.name)
    tmp.rmdir()
