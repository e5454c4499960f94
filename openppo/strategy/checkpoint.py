"""Checkpoint directory bookkeeping: tag names, rotation and the `latest` pointer.

DeepSpeed writes a checkpoint into `<ckpt_dir>/<tag>/` and then rewrites `<ckpt_dir>/latest`. openppo writes
its own controller state (`client_state.json`) inside the tag folder before DeepSpeed updates `latest`, so a
crash mid-save leaves `latest` pointing at the previous complete checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

TAG_PATTERN = re.compile(r"^global_step(\d+)$")


def tag_for_step(step: int) -> str:
    return f"global_step{step}"


def list_tags(ckpt_dir: str | Path) -> list[str]:
    """Checkpoint tags in `ckpt_dir`, oldest step first."""
    path = Path(ckpt_dir)
    if not path.is_dir():
        return []
    tags = [(int(m.group(1)), p.name) for p in path.iterdir() if p.is_dir() and (m := TAG_PATTERN.match(p.name))]
    return [name for _, name in sorted(tags)]


def latest_tag(ckpt_dir: str | Path) -> str | None:
    """The tag DeepSpeed's `latest` file names, if it exists and its folder is there."""
    latest = Path(ckpt_dir) / "latest"
    if not latest.is_file():
        return None
    tag = latest.read_text().strip()
    return tag if (Path(ckpt_dir) / tag).is_dir() else None


def rotate(ckpt_dir: str | Path, keep: int) -> list[str]:
    """Delete the oldest checkpoints so that at most `keep` remain; never the one `latest` names."""
    if keep <= 0:
        return []
    tags = list_tags(ckpt_dir)
    current = latest_tag(ckpt_dir)
    removed = []
    for tag in tags[: max(0, len(tags) - keep)]:
        if tag == current:
            continue
        shutil.rmtree(Path(ckpt_dir) / tag, ignore_errors=True)
        removed.append(tag)
    return removed


def write_json_atomic(path: str | Path, data: dict) -> None:
    """Write JSON via a temp file and rename, so readers never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
    os.replace(tmp, path)
