"""--use_liger_kernel (`openppo.models.liger`): on CPU the model keeps transformers' modules and the run says so once;
on a GPU the model's own modules get Liger's kernels before LoRA wraps them.

Liger's patch functions import its Triton GPU kernels, which cannot load on a CPU-only machine: the GPU-side tests
stand a recording module in for `liger_kernel.transformers.monkey_patch` (the one mock here; the real package is
checked on CUDA by tests/gpu/test_liger_cuda.py, log-probs and gradients against the plain model)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from openppo.errors import UserError
from openppo.models.actor import Actor
from openppo.models.liger import KERNELS, apply_liger, liger_notice
from tests.model_cache import tiny_model_dir


def _stand_in(monkeypatch) -> list[dict]:
    """Liger's monkey_patch module as a recorder of the patch calls it gets; qwen2 is a model type it knows."""
    calls: list[dict] = []
    module = types.ModuleType("liger_kernel.transformers.monkey_patch")
    module.MODEL_TYPE_TO_APPLY_LIGER_FN = {"qwen2": None, "llama": None}
    module._apply_liger_kernel_to_instance = lambda model, **kwargs: calls.append({"model": model, **kwargs})
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", module)
    return calls


def test_on_cpu_the_model_is_left_as_it_is_and_the_run_says_so():
    assert liger_notice(True, on_gpu=False).startswith("--use_liger_kernel has no effect on CPU")
    assert liger_notice(True, on_gpu=True) is None and liger_notice(False, on_gpu=False) is None
    torch.manual_seed(0)
    seqs = torch.randint(10, 1000, (2, 12))
    plain = Actor.from_pretrained(str(tiny_model_dir()), dtype=torch.float32)
    liger = Actor.from_pretrained(str(tiny_model_dir()), dtype=torch.float32, use_liger_kernel=True)
    assert [type(m) for m in liger.modules()] == [type(m) for m in plain.modules()]
    assert not any("forward" in vars(m) for m in liger.modules())  # no forward bound on an instance
    mask = torch.ones_like(seqs)
    torch.testing.assert_close(liger(seqs, mask).log_probs, plain(seqs, mask).log_probs, atol=0, rtol=0)


def test_on_a_gpu_the_models_own_modules_get_the_kernels_before_lora(monkeypatch):
    calls = _stand_in(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    actor = Actor.from_pretrained(str(tiny_model_dir()), dtype=torch.float32, use_liger_kernel=True, lora_rank=4)
    assert len(calls) == 1 and {k: v for k, v in calls[0].items() if k != "model"} == KERNELS
    # the transformers model itself, before the adapters (Liger binds its forwards onto the modules LoRA then wraps)
    assert calls[0]["model"] is actor.hf_model and type(calls[0]["model"]).__name__ == "Qwen2ForCausalLM"
    assert KERNELS["fused_linear_cross_entropy"] is False  # RL needs per-token log-probs, not a mean loss


def test_a_model_type_liger_lacks_is_named_and_a_missing_package_is_a_one_line_error(monkeypatch):
    calls = _stand_in(monkeypatch)
    model = types.SimpleNamespace(config=types.SimpleNamespace(model_type="gpt_neox"))
    assert apply_liger(model, on_gpu=True) == "Liger has no kernels for model type 'gpt_neox'" and not calls
    assert apply_liger(model, on_gpu=False) == "no GPU"
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", None)  # not installed
    with pytest.raises(UserError, match=r"--use_liger_kernel needs the liger-kernel package .*requirements/gpu.txt"):
        apply_liger(model, on_gpu=True)
