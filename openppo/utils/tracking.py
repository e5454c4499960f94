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

    def __init__(
        self,
        *,
        save_dir: str | None,
        tensorboard_dir: str | None,
        wandb: str | None,
        wandb_project: str,
        run_name: str,
        config: dict[str, Any],
        enabled: bool = True,
        wandb_org: str | None = None,
        wandb_group: str | None = None,
    ):
        self.enabled = enabled
        self._warned: set[str] = set()
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
            self._wandb = _start_wandb(wandb, wandb_project, run_name, config, save_dir, wandb_org, wandb_group)

    def log(self, step: int, metrics: dict[str, float], *, echo: bool = True) -> None:
        """Every sink gets every value, NaN and Inf included: a diverged loss must show, not vanish. In
        metrics.jsonl they are the strings "nan", "inf" and "-inf" (strict JSON has no such numbers)."""
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in metrics.items() if v is not None}
        bad = sorted(k for k, v in clean.items() if not math.isfinite(v) and k not in self._warned)
        if bad:
            self._warned.update(bad)
            logger.warning(
                "step %d: non-finite metric(s) %s (logged as such; warned once per metric)",
                step,
                ", ".join(f"{k}={clean[k]}" for k in bad),
            )
        if echo:
            logger.info("step %d | %s", step, " ".join(f"{k}={_format(v)}" for k, v in sorted(clean.items())))
        if self._jsonl:
            row = {k: v if math.isfinite(v) else str(v) for k, v in clean.items()}
            self._jsonl.write(json.dumps({"step": step, "time": time.time(), **row}) + "\n")
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


def set_aside_rows_after(path: str | Path, step: int) -> Path | None:
    """A resumed run rewinds to `step`: the rows of the JSONL log `path` whose "step" is later (written by the run
    that crashed after its last checkpoint) move to `<stem>.after_step<step>.jsonl` beside it, so the log holds each
    step once; one log line says so. The moved rows are written (and flushed) before `path` is cut, so a crash in
    between duplicates rows rather than losing them. `path` is rewritten in place, so a writer that holds it open
    for appending keeps writing to it. Returns the file the rows went to, or None when there were none."""
    path = Path(path)
    if not path.is_file():
        return None
    with open(path, encoding="utf-8") as f:
        rows = [line for line in f if line.strip()]
    is_later = [json.loads(line).get("step", 0) > step for line in rows]
    later = [line for line, moved in zip(rows, is_later) if moved]
    if not later:
        return None
    aside = path.with_name(f"{path.stem}.after_step{step}.jsonl")
    with open(aside, "a", encoding="utf-8") as f:
        f.writelines(later)
        f.flush()
        os.fsync(f.fileno())
    with open(path, "r+", encoding="utf-8") as f:
        f.writelines(line for line, moved in zip(rows, is_later) if not moved)
        f.truncate()
    logger.info("resume at step %d: the rows of %s after it were moved to %s", step, path.name, aside.name)
    return aside


def _start_wandb(
    value: str,
    project: str,
    run_name: str,
    config: dict[str, Any],
    save_dir: str | None,
    org: str | None = None,
    group: str | None = None,
):
    """`value` is an API key, 'offline', or 'auto' (online when a key is configured, offline otherwise)."""
    import wandb

    mode = "online"
    if value == "offline" or (
        value == "auto" and not os.environ.get("WANDB_API_KEY") and not Path("~/.netrc").expanduser().exists()
    ):
        mode = "offline"
    elif value not in ("auto", "online"):
        wandb.login(key=value)
    run = wandb.init(
        project=project, entity=org, group=group, name=run_name, config=config, mode=mode, dir=save_dir, reinit=True
    )
    logger.info("W&B run %s (%s mode)", run.name, mode)
    return run
