"""Per-device memory estimate of a train_ppo_ray run before launching it.

    python -m openppo.cli.plan <the same flags as train_ppo_ray> [--device_memory_gib 80]

Prints what one device of each kind holds (weights, gradients, optimizer states, activations and logits of the
largest micro-batch, vLLM weights and KV cache) and warns when a device would not fit. Nothing is loaded but the
models' config files (the parameter counts come from a meta-device build). See openppo/ppo/memory_plan.py.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field

import torch

from openppo.cli.runner import run_cli
from openppo.config.schema import opt
from openppo.errors import require
from openppo.models.loading import resolve_model_path
from openppo.ppo.config import PPOConfig
from openppo.ppo.memory_plan import GIB, ModelShape, plan_devices, plan_text
from openppo.ppo.validate import needs_critic_group, validate

logger = logging.getLogger("openppo.plan")


@dataclass
class PlanOptions:
    """The planner's own option."""

    device_memory_gib: float = opt(None, "memory of one device (default: this machine's GPU, or its RAM on CPU)")


@dataclass
class PlanConfig(PPOConfig):
    plan: PlanOptions = field(default_factory=PlanOptions)


def model_shape(path: str, flag: str, *, scalar: bool = False) -> ModelShape:
    """Parameter counts from a meta-device build of the model (no weights are read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(resolve_model_path(path, flag), trust_remote_code=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=True)
    embed = model.get_input_embeddings().weight.numel()
    head = model.get_output_embeddings()
    tied = head is None or head.weight is model.get_input_embeddings().weight
    num_params = sum(p.numel() for p in model.parameters())  # tied weights once
    if scalar:  # a value/reward model: the LM head is replaced by a hidden -> 1 head
        num_params -= 0 if tied else head.weight.numel()
        num_params += config.hidden_size
    return ModelShape(num_params=num_params, embedding_params=embed + (0 if tied or scalar else head.weight.numel()),
                      num_layers=config.num_hidden_layers, hidden=config.hidden_size,
                      intermediate=getattr(config, "intermediate_size", 4 * config.hidden_size),
                      vocab=config.vocab_size)


def _device_bytes(cfg: PlanConfig) -> float:
    if cfg.plan.device_memory_gib:
        return cfg.plan.device_memory_gib * GIB
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    from openppo.utils.resources import host_memory_gib

    return host_memory_gib() * GIB


def plan(cfg: PlanConfig) -> None:
    gib = cfg.plan.device_memory_gib
    require(gib is None or gib > 0, f"--device_memory_gib must be positive (GiB of one device), got {gib}")
    for notice in validate(cfg, on_gpu=torch.cuda.is_available()):
        logger.info("note: %s", notice)
    m = cfg.model
    shapes = {"actor": model_shape(m.pretrain, "--pretrain")}
    if needs_critic_group(cfg):
        shapes["critic"] = model_shape(m.critic_pretrain or m.reward_pretrain or m.pretrain, "--critic_pretrain",
                                       scalar=True)
    if m.reward_pretrain:
        shapes["reward"] = model_shape(m.reward_pretrain, "--reward_pretrain", scalar=True)
    device = _device_bytes(cfg)
    text, fits = plan_text(plan_devices(cfg, shapes, device, on_gpu=torch.cuda.is_available()), device)
    print(text)
    if not fits:
        logger.warning("the run would not fit: see the devices marked above (--gradient_checkpointing, "
                       "--zero_stage 3, --adam_offload, --ref_reward_offload or smaller micro-batches help)")


def main(argv=None) -> int:
    return run_cli(plan, PlanConfig, "openppo.cli.plan", __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
