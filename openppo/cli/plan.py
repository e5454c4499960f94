"""Per-device memory estimate of a train_ppo_ray run before launching it.

    python -m openppo.cli.plan <the same flags as train_ppo_ray> [--device_memory_gib 80]

Prints what one device of each kind holds (weights, gradients, optimizer states, activations and logits of the
largest micro-batch, vLLM weights and KV cache) and warns when a device would not fit. Then the largest training
token budget (--use_dynamic_batch --train_max_tokens_per_gpu) that keeps the training devices within 80 % of their
memory: on GPUs larger micro-batches move more tokens a second (docs/performance.md). Nothing is loaded but the
models' config files (the parameter counts come from a meta-device build). See openppo/ppo/memory_plan.py.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from openppo.cli.runner import run_cli
from openppo.config.schema import opt
from openppo.errors import require
from openppo.ppo.config import PPOConfig
from openppo.ppo.memory_plan import (
    BUDGET_SHARE,
    GIB,
    default_token_budget,
    largest_token_budget,
    plan_devices,
    plan_text,
    run_shapes,
)
from openppo.ppo.validate import validate

logger = logging.getLogger("openppo.plan")


@dataclass
class PlanOptions:
    """The planner's own option."""

    device_memory_gib: float = opt(None, "memory of one device (default: this machine's GPU, or its RAM on CPU)")


@dataclass
class PlanConfig(PPOConfig):
    # the planner sizes a run for this machine (or --device_memory_gib) and starts no cluster
    precision_on_cluster: ClassVar[bool] = False

    plan: PlanOptions = field(default_factory=PlanOptions)


def _device_bytes(cfg: PlanConfig) -> float:
    if cfg.plan.device_memory_gib:
        return cfg.plan.device_memory_gib * GIB
    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).total_memory
    from openppo.utils.hardware import host_memory_gib

    return host_memory_gib() * GIB


def plan(cfg: PlanConfig) -> None:
    gib = cfg.plan.device_memory_gib
    require(gib is None or gib > 0, f"--device_memory_gib must be positive (GiB of one device), got {gib}")
    for notice in validate(cfg, on_gpu=torch.cuda.is_available()):
        logger.info("note: %s", notice)
    shapes = run_shapes(cfg)
    device = _device_bytes(cfg)
    # the budget a run on such devices would take (train_ppo_ray's launch: `launch.resolve_token_budget`)
    cfg.rollout.train_max_tokens_per_gpu, line = default_token_budget(cfg, device, torch.cuda.is_available(), shapes)
    if line:
        logger.info(line)
    text, fits = plan_text(plan_devices(cfg, shapes, device, on_gpu=torch.cuda.is_available()), device)
    print(text)
    budget = largest_token_budget(cfg, shapes, device, on_gpu=torch.cuda.is_available())
    if budget is not None:
        # larger micro-batches run fewer, larger kernels: on GPUs the step's tokens a second grow with them
        print(
            f"largest token budget within {BUDGET_SHARE:.0%} of a device: --use_dynamic_batch "
            f"--train_max_tokens_per_gpu {budget.tokens} ({budget.planned_bytes / GIB:.2f} GiB planned)"
        )
    if not fits:
        logger.warning(
            "the run would not fit: see the devices marked above (--gradient_checkpointing, "
            "--zero_stage 3, --adam_offload, --ref_reward_offload or smaller micro-batches help)"
        )


def main(argv=None) -> int:
    return run_cli(plan, PlanConfig, "openppo.cli.plan", __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
