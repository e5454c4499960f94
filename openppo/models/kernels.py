"""Fewer, larger kernels in the models a run builds: Liger's fused kernels (--use_liger_kernel) and the decoder layers
compiled (--torch_compile).

--use_liger_kernel puts Liger's GPU kernels for RMSNorm, RoPE and the SwiGLU MLP into the model's own modules
(`_apply_liger_kernel_to_instance` of the `liger-kernel` package, the per-instance form of its
`apply_liger_kernel_to_<model type>` patches), before LoRA adapters wrap the linear layers: transformers' RMSNorm is
five element-wise launches per call, its MLP three plus the matmuls. Liger's fused linear cross-entropy is not used:
RL needs each token's log-prob and entropy, not a mean loss, and --lm_head_chunk_tokens (`openppo.models.lm_head`)
already keeps the full logits from being made.

Liger's kernels are Triton GPU kernels: on a machine without CUDA the model keeps transformers' modules, and the run
says so in one line (`liger_notice`).

--torch_compile compiles each decoder layer in place (`compile_layers`; regional compilation): the layers share
their code, and torch.compile takes their weights as inputs, so one compiled graph serves them all (one compile, not
one per layer; the whole model would be one large graph, slow to compile and recompiled on any change). It runs
last, over the LoRA adapters and the activation checkpointing. Packed rows' attention stays outside the graph
(`varlen_attention_forward` is opaque to the compiler: its bounds are Python ints), so the layer breaks there once
and its pieces take any row length. On CPU it compiles too (Inductor's C++ backend); the first forward and backward
pay the compile (~30 s for a tiny model on a 2-core CPU), the second length a recompile with the length dynamic,
then none.

The two are refused together (`check_liger_compile`): inside the compiled layers, Inductor cannot analyse Liger's
Triton kernels (it logs that it assumes every input mutated), and on an H200 the 0.5B step with both got non-finite
gradients in 2 of every 3 steps, where each alone trained.
"""

from __future__ import annotations

import torch
from torch import nn

from openppo.errors import UserError
from openppo.models.hf import base_model

# what Liger replaces: its patch function's flags (the ones a model type's function lacks are dropped by Liger)
KERNELS = dict(rope=True, rms_norm=True, swiglu=True, cross_entropy=False, fused_linear_cross_entropy=False)
INSTALL = "pip install -r requirements/gpu.txt (it pins liger-kernel)"


def liger_notice(use_liger_kernel: bool, on_gpu: bool) -> str | None:
    """The run's line where --use_liger_kernel has no effect on its devices."""
    if use_liger_kernel and not on_gpu:
        return "--use_liger_kernel has no effect on CPU: Liger's kernels are Triton GPU kernels (transformers' own run)"
    return None


def liger_model_types() -> frozenset[str]:
    """The model types Liger has kernels for; none where the liger-kernel package is not installed."""
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError:
        return frozenset()
    return frozenset(MODEL_TYPE_TO_APPLY_LIGER_FN)


def apply_liger(model: torch.nn.Module, on_gpu: bool | None = None) -> str | None:
    """Put Liger's kernels into the transformers model `model` in place. Returns why nothing was put (no GPU, a model
    type Liger has no kernels for), else None. `on_gpu`: default, whether this process sees CUDA."""
    if not (torch.cuda.is_available() if on_gpu is None else on_gpu):
        return "no GPU"
    try:
        from liger_kernel.transformers.monkey_patch import (
            MODEL_TYPE_TO_APPLY_LIGER_FN,
            _apply_liger_kernel_to_instance,
        )
    except ImportError as exc:
        raise UserError(f"--use_liger_kernel needs the liger-kernel package ({exc}): {INSTALL}") from exc
    model_type = getattr(model.config, "model_type", None)
    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        return f"Liger has no kernels for model type {model_type!r}"
    _apply_liger_kernel_to_instance(model=model, **KERNELS)
    return None


def compile_layers(model: nn.Module, mode: str | None = None) -> int:
    """torch.compile each decoder layer of the transformers (or PEFT) model `model` in place; returns how many.
    `mode`: torch.compile's (None: its default). "reduce-overhead" replays each compiled piece as a CUDA graph, one
    recording per layer (their weights' addresses differ) and per row length; only `bench/train_step_mfu.py`'s
    --compile_mode sets it so far, on rows of one length, until a GPU sitting shows whether the graphs pay."""
    base = base_model(model)
    layers = getattr(getattr(base, getattr(base, "base_model_prefix", ""), base), "layers", None)
    if not isinstance(layers, nn.ModuleList):
        return 0
    for layer in layers:
        layer.compile(mode=mode)
    return len(layers)


LIGER_WITH_COMPILE = (
    "--use_liger_kernel with --torch_compile: Liger's Triton kernels inside the compiled decoder layers gave "
    "non-finite gradients on an H200 (2 of 3 steps of a 0.5B model skipped; docs/benchmarks.md); use one of the "
    "two (--use_liger_kernel alone was the faster there)"
)


def check_liger_compile(use_liger_kernel: bool, torch_compile: bool) -> None:
    """Refuse Liger's kernels inside compiled layers, on every device, so that a recipe that starts on CPU (where
    Liger has no effect) does not first fail on a GPU."""
    if use_liger_kernel and torch_compile:
        raise UserError(LIGER_WITH_COMPILE)


def check_compile(
    torch_compile: bool, *, use_liger_kernel: bool, zero_stage: int, ring_attn_size: int, tensor_parallel_size: int
) -> None:
    """--torch_compile's settings; raise UserError naming the flags."""
    if not torch_compile:
        return
    check_liger_compile(use_liger_kernel, torch_compile)
    if zero_stage == 3:
        raise UserError(
            "--torch_compile with --zero_stage 3: ZeRO-3 gathers each layer's weights through hooks the compiled "
            "layers would skip; use --zero_stage 2, or --deepcompile (DeepSpeed's own compiler, GPU)"
        )
    for size, flag in ((ring_attn_size, "--ring_attn_size"), (tensor_parallel_size, "--ds_tensor_parallel_size")):
        if size > 1:
            raise UserError(
                f"--torch_compile with {flag} {size}: its collectives run inside each decoder layer, where the "
                f"compiler would split the graph at every one; drop one of the two"
            )
