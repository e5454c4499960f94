"""`--target_modules all-linear`, as OpenRLHF recipes pass it, adapts the same layers as the default."""

from __future__ import annotations

import torch

from openppo.models.loading import apply_lora
from tests.model_cache import tiny_model_dir


def _adapted(target_modules):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir(), dtype=torch.float32)
    peft = apply_lora(model, rank=4, alpha=8, dropout=0.0, target_modules=target_modules, task_type="CAUSAL_LM")
    return sorted(n for n, _ in peft.named_modules() if n.endswith(".lora_A"))


def test_all_linear_named_in_a_list_is_the_default():
    default = _adapted(None)
    assert default and _adapted(["all-linear"]) == default
    assert _adapted(["q_proj"]) == [n for n in default if ".q_proj." in n]
