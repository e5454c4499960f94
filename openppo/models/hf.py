"""HF model folders in and out: loading models and tokenizers from user-given paths (with errors that name the
flag), and writing models back as HF folders (full weights, or only the LoRA adapter for PEFT models)."""

from __future__ import annotations

import functools
import logging
import os
import re
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from openppo.errors import UserError

logger = logging.getLogger(__name__)

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def attention_kernel(name: str, dtype: torch.dtype | None = None) -> str:
    """The `--attn_implementation` to load a model of `dtype` with: `name`, or sdpa where flash_attention_2 cannot run
    (no CUDA device, no flash-attn package, or a model computing in fp32), with one log line per process. OpenRLHF's
    and Molt's recipes ask for flash_attention_2; sdpa computes the same attention (and dispatches to flash kernels
    on GPUs)."""
    if name != "flash_attention_2":
        return name
    import importlib.util

    if not torch.cuda.is_available():
        _say_once("--attn_implementation flash_attention_2 needs a CUDA device: sdpa instead (the same attention)")
    elif importlib.util.find_spec("flash_attn") is None:
        _say_once(
            "--attn_implementation flash_attention_2 needs the flash-attn package, which is not installed: sdpa "
            "instead (the same attention, with flash kernels on this GPU)"
        )
    elif dtype is not None and dtype not in (torch.float16, torch.bfloat16):
        # transformers only warns, and flash-attn's kernels then refuse the first forward's fp32 inputs
        _say_once(
            f"--attn_implementation flash_attention_2 computes in fp16 or bf16 only, and this model computes in "
            f"{str(dtype).removeprefix('torch.')} (--param_dtype): sdpa instead (the same attention)"
        )
    else:
        return name
    return "sdpa"


@functools.cache
def _say_once(message: str) -> None:
    logger.warning(message)


def resolve_model_path(path: str | None, flag: str) -> str:
    """Check that `path` is a model folder (or a hub id where a hub is reachable) and return it."""
    if not path:
        raise UserError(
            f"{flag} is required: pass a local HF model folder "
            f"(e.g. python -m openppo.cli.models smollm2 --out models/smollm2)"
        )
    p = Path(path).expanduser()
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise UserError(f"{flag}: {path} has no config.json; pass a folder saved by save_pretrained")
        return str(p)
    offline = os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("TRANSFORMERS_OFFLINE") == "1"
    if _HUB_ID.match(path) and not path.startswith((".", "/", "~")) and not offline:
        return path
    raise UserError(
        f"{flag}: model folder {path} not found; pass a local HF model folder "
        f"(python -m openppo.cli.models smollm2|tiny --out DIR makes one)"
    )


def is_mixture_of_experts(path: str) -> bool:
    """Whether the model folder's config routes tokens to experts (Mixtral, Qwen-MoE, OLMoE, ...)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, trust_remote_code=True)
    return bool(getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None))


# The names of the parameters a run freezes that the engines loaded from the same checkpoint (a frozen vision tower,
# frozen MoE routers), kept on the model: the weight sync leaves them out, as nothing changes them.
FROZEN_PARAMETERS = "openppo_frozen_parameters"


def freeze_parameters(model: nn.Module, names: Sequence[str]) -> list[str]:
    """Stop the gradient of the named parameters of `model` and add them to its `FROZEN_PARAMETERS`."""
    chosen = set(names)
    for name, p in model.named_parameters():
        if name in chosen:
            p.requires_grad_(False)
    setattr(model, FROZEN_PARAMETERS, frozenset(getattr(model, FROZEN_PARAMETERS, frozenset()) | chosen))
    return list(names)


def moe_router_parameter_names(model: nn.Module) -> list[str]:
    """The parameters of a mixture-of-experts model's routers: transformers' router modules (`*Router`, e.g.
    Qwen3-MoE's `mlp.gate`), and a MoE block's `gate` / `router` / `shared_expert_gate` (Qwen2-MoE gates its shared
    expert too). A dense MLP's `gate_proj` is none of them."""
    modules = dict(model.named_modules())
    routers = []
    for name, module in modules.items():
        parent, _, leaf = name.rpartition(".")
        in_moe_block = "moe" in type(modules.get(parent)).__name__.lower()
        if "router" in type(module).__name__.lower() or (
            in_moe_block and leaf in ("gate", "router", "shared_expert_gate")
        ):
            routers.append(name)
    return [f"{router}.{n}" for router in routers for n, _ in modules[router].named_parameters()]


def kv_heads(model_path: str) -> int:
    """Key/value heads of a model folder (its config.json only; a ring exchanges them --ring_head_stride at a
    time)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def aux_loss_notice(aux_loss_coef: float, path: str) -> str | None:
    """The one-line notice of an --aux_loss_coef that has nothing to weigh: the trained model has no router."""
    if aux_loss_coef > 0 and not is_mixture_of_experts(path):
        return f"--aux_loss_coef has no effect: {path} is not a mixture-of-experts model (it has no router)"
    return None


def router_aux_loss(hf_model: nn.Module, router_logits, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """A mixture-of-experts backbone's load-balancing loss from its per-layer router logits, by the architecture's
    own transformers function (what its *ForCausalLM returns as `aux_loss`). `attention_mask` weighs each token of
    the batch in the loss's per-expert means: 0/1 for padding, or how many rows a shared prompt's token stands for."""
    config = hf_model.config
    loss_fn = getattr(sys.modules[type(hf_model).__module__], "load_balancing_loss_func", None)
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if loss_fn is None or not experts:
        raise ValueError(f"{type(hf_model).__name__} has no router load-balancing loss (not a mixture of experts)")
    return loss_fn(router_logits, experts, config.num_experts_per_tok, attention_mask)


def load_tokenizer(path: str, padding_side: str = "right", chat_template: str | None = None, use_fast: bool = True):
    """The model's tokenizer with a pad token (the EOS token stands in when it has none); `chat_template`
    (--tokenizer_chat_template) replaces its own chat template, and is saved with the trained model.
    `use_fast=False` (--disable_fast_tokenizer) asks for the slow Python tokenizer where the model has one."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=True, use_fast=use_fast)
    if not use_fast and tokenizer.is_fast:
        logger.warning(
            "--disable_fast_tokenizer has no effect: %s has no slow tokenizer in this transformers version", path
        )
    tokenizer.padding_side = padding_side
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def vocabulary_difference(ours, theirs) -> str | None:
    """Where two tokenizers give a token id different meanings, in a few words (None when every id, added tokens
    included, is the same string in both and the end-of-sequence id agrees). A model that scores another model's
    token ids (a distillation teacher) must read them as that model wrote them. Chat templates may differ: the ids
    are scored as they were sampled, whatever template made the prompt."""
    mine, other = ours.get_vocab(), theirs.get_vocab()
    if len(mine) != len(other):
        return f"{len(other)} tokens against {len(mine)}"
    by_id, other_by_id = {i: t for t, i in mine.items()}, {i: t for t, i in other.items()}
    for i in sorted(by_id):
        if other_by_id.get(i) != by_id[i]:
            return f"token id {i} is {other_by_id.get(i)!r} there and {by_id[i]!r} here"
    if ours.eos_token_id != theirs.eos_token_id:
        return f"end-of-sequence id {theirs.eos_token_id} there and {ours.eos_token_id} here"
    return None


def torch_dtype(name: str) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def apply_lora(model, *, rank: int, alpha: int, dropout: float, target_modules: list[str] | None, task_type: str):
    """Wrap `model` with PEFT LoRA adapters; only the adapters (and a score head) stay trainable. A vision-language
    model gets its adapters in its language model only (the decoder's linears among `target_modules`)."""
    from peft import LoraConfig, get_peft_model

    every_linear = target_modules in (None, [], ["all-linear"])
    from openppo.models.vision import decoder_linear_names, is_vision_language

    if is_vision_language(model.config):
        targets = decoder_linear_names(model, None if every_linear else target_modules)
        if not targets:
            raise UserError(
                f"--target_modules {' '.join(target_modules or [])}: none of the language model's linear layers has "
                f"such a name; pass names of its layers (e.g. q_proj v_proj) or all-linear"
            )
    else:
        # OpenRLHF recipes pass `--target_modules all-linear`: PEFT knows that shorthand only as a plain string
        targets = "all-linear" if every_linear else target_modules
    config = LoraConfig(
        r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, task_type=task_type, bias="none"
    )
    model = get_peft_model(model, config)
    # peft keeps the adapters in the base dtype; fp32 adapters train more stably and are cast at sync/merge.
    return model


def base_model(model: nn.Module) -> nn.Module:
    """The transformers model under PEFT's wrapper (the one the adapters were put into); any other model as is."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def finish_model(
    model,
    *,
    task_type: str,
    lora_rank: int,
    lora_alpha: int,
    lora_dropout: float,
    target_modules: list[str] | None,
    gradient_checkpointing: bool,
    reentrant_checkpointing: bool = False,
    use_liger_kernel: bool = False,
    torch_compile: bool = False,
    freeze_moe_router: bool = False,
):
    """Frozen MoE routers (`--freeze_moe_router`: routing held fixed, so the trained and the engines' routing stay
    alike), optional Liger kernels, LoRA adapters, activation checkpointing and compiled layers, in that order (Liger
    patches the model's own modules, which the adapters then wrap; checkpointing must see the adapters; the compiled
    layers hold all of it)."""
    from openppo.models.kernels import check_liger_compile

    check_liger_compile(use_liger_kernel, torch_compile)  # (also for callers that skip the flags' checks)
    if freeze_moe_router:
        frozen = freeze_parameters(model, moe_router_parameter_names(model))
        if not frozen and first_rank():
            logger.warning("--freeze_moe_router has no effect on %s: it has no router", type(model).__name__)
    if use_liger_kernel:
        from openppo.models.kernels import apply_liger

        why = apply_liger(model)
        if why and why != "no GPU" and first_rank():  # (no GPU: the run's own notice says so, once)
            logger.warning("--use_liger_kernel has no effect on %s: %s", type(model).__name__, why)
    if lora_rank > 0:
        model = apply_lora(
            model,
            rank=lora_rank,
            alpha=lora_alpha,
            dropout=lora_dropout,
            target_modules=target_modules,
            task_type=task_type,
        )
    if gradient_checkpointing:
        enable_gradient_checkpointing(model, reentrant_checkpointing)
    if torch_compile:
        from openppo.models.kernels import compile_layers

        if not compile_layers(model) and first_rank():
            logger.warning("--torch_compile has no effect on %s: no decoder layers found", type(model).__name__)
    return model


def first_rank() -> bool:
    """Whether this process logs a model's one-line notices: rank 0, or a process outside torch.distributed."""
    return not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0


def enable_gradient_checkpointing(model, reentrant: bool = False) -> None:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    if hasattr(model, "enable_input_require_grads"):
        # Needed with LoRA: frozen embeddings would otherwise cut the graph before the first checkpoint.
        model.enable_input_require_grads()


# -- saving ------------------------------------------------------------------------------------------------------------


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
    config = base_model(model).config
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
    processor = getattr(module, "processor", None)  # a vision-language Actor's: serving its images needs it
    if processor is not None:
        processor.save_pretrained(tmp)
    if tokenizer is not None:  # after the processor's copy of it: the run's tokenizer (its chat template) wins
        tokenizer.save_pretrained(tmp)
    # The save path also holds metrics, run info and checkpoints: move the model files in one by one
    # (each os.replace is atomic) instead of swapping the whole folder.
    out_dir.mkdir(parents=True, exist_ok=True)
    for item in tmp.iterdir():
        os.replace(item, out_dir / item.name)
    tmp.rmdir()
