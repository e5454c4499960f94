"""Metrics sinks: stdout, `metrics.jsonl`, TensorBoard and Weights & Biases. Only rank 0 writes."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def _format(value: float) -> str:
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer() and abs(value) < 1e9):
        return str(int(value))
    return f"{value:.4g}"


class MetricsTracker:
    """Fan-out of `log(step, metrics)` to every enabled sink."""

    def __init__(self, *, save_dir: str | None, tensorboard_dir: str | None, wandb: str | None,
                 wandb_project: str, run_name: str, config: dict[str, Any], enabled: bool = True):
        self.enabled = enabled
        self._jsonl = None
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        if save_dir:
            Path(save_dir).mkdir(parents=True, exist_ok=True)
            self._jsonl = open(Path(save_dir) / "metrics.jsonl", "a", buffering=1)
        if tensorboard_dir:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(Path(tensorboard_dir) / run_name))
        if wandb:
            self._wandb = _start_wandb(wandb, wandb_project, run_name, config, save_dir)

    def log(self, step: int, metrics: dict[str, float], *, echo: bool = True) -> None:
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}
        if echo:
            logger.info("step %d | %s", step, " ".join(f"{k}={_format(v)}" for k, v in sorted(clean.items())))
        if self._jsonl:
            self._jsonl.write(json.dumps({"step": step, "time": time.time(), **clean}) + "\n")
        if self._tb:
            for key, value in clean.items():
                self._tb.add_scalar(key, value, step)
        if self._wandb:
            self._wandb.log(clean, step=step)

    def close(self) -> None:
        if self._jsonl:
            self._jsonl.close()
        if self._tb:
            self._tb.close()
        if self._wandb:
            self._wandb.finish()


def _start_wandb(value: str, project: str, run_name: str, config: dict[str, Any], save_dir: str | None):
    """`value` is an API key, 'offline', or 'auto' (online when a key is configured, offline otherwise)."""
    import wandb

    mode = "online"
    if value == "offline" or (value == "auto" and not os.environ.get("WANDB_API_KEY")
                              and not Path("~/.netrc").expanduser().exists()):
        mode = "offline"
    elif value not in ("auto", "online"):
        wandb.login(key=value)
    run = wandb.init(project=project, name=run_name, config=config, mode=mode, dir=save_dir, reinit=True)
    logger.info("W&B run %s (%s mode)", run.name, mode)
    return run
