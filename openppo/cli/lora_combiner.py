"""Merge a LoRA adapter into its base model and save a plain HF folder: `python -m openppo.cli.lora_combiner`."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

from openppo.cli.runner import run_cli
from openppo.config.schema import opt
from openppo.errors import require
from openppo.models.hf import load_tokenizer, resolve_model_path, torch_dtype
from openppo.utils.paths import check_output_dir


@dataclass
class LoraCombinerConfig:
    model_path: str = opt(None, "base model folder the adapter was trained on", metavar="PATH")
    lora_path: str = opt(None, "adapter folder written by a --lora_rank run", metavar="PATH")
    output_path: str = opt(None, "where to write the merged model", metavar="DIR")
    is_rm: bool = opt(False, "the adapter belongs to a reward model / critic (scalar head)")
    param_dtype: str = opt("bf16", "dtype of the merged weights", choices=("bf16", "fp16", "fp32"))


def combine(cfg: LoraCombinerConfig) -> None:
    from peft import PeftModel
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    base_path = resolve_model_path(cfg.model_path, "--model_path")
    require(
        bool(cfg.lora_path) and (Path(cfg.lora_path) / "adapter_config.json").is_file(),
        f"--lora_path: {cfg.lora_path} has no adapter_config.json; pass the folder a --lora_rank run saved",
    )
    require(bool(cfg.output_path), "--output_path is required: the folder to write the merged model to")
    check_output_dir(cfg.output_path, "--output_path")
    dtype = torch_dtype(cfg.param_dtype)
    if cfg.is_rm:
        config = AutoConfig.from_pretrained(base_path, num_labels=1)
        base = AutoModelForSequenceClassification.from_pretrained(base_path, config=config, dtype=dtype)
    else:
        base = AutoModelForCausalLM.from_pretrained(base_path, dtype=dtype)
    merged = PeftModel.from_pretrained(base, cfg.lora_path).merge_and_unload()
    # Carry over what the training run stored in the config beside the adapter (e.g. reward normalisation).
    saved_config = Path(cfg.lora_path) / "config.json"
    if saved_config.is_file():
        for key in ("value_mean", "value_std"):
            value = json.loads(saved_config.read_text()).get(key)
            if value is not None:
                setattr(merged.config, key, value)
    merged.save_pretrained(cfg.output_path, safe_serialization=True)
    load_tokenizer(
        cfg.lora_path if (Path(cfg.lora_path) / "tokenizer_config.json").is_file() else base_path
    ).save_pretrained(cfg.output_path)
    print(f"merged {cfg.lora_path} into {base_path} -> {cfg.output_path}")


def main(argv=None) -> int:
    return run_cli(combine, LoraCombinerConfig, "openppo.cli.lora_combiner", __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
