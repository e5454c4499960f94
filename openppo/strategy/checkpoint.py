"""Checkpoint directory bookkeeping: tag names, the commit marker that makes a step resumable, rotation.

A checkpoint of step N has one part per trained model, each a DeepSpeed tag folder, and a commit marker that the
controller writes only after every part is saved:

    <ckpt_dir>/actor/global_step4/          DeepSpeed files of the actor (+ client_state.json, for reading)
    <ckpt_dir>/critic/global_step4/         the critic's (PPO with a critic only)
    <ckpt_dir>/committed/global_step4.json  {"global_step": 4, "tag": "global_step4", "parts": [...], "state": ...}

The supervised trainers have one part, the checkpoint folder itself (part "."). The marker holds the controller
state (step, prompt or data position, KL controller) and is the commit point: the parts' files are fsynced, then
the marker is written to a temp file, fsynced and renamed into place, so it is either absent or whole. A resume
takes the newest marker that parses and whose part folders all exist; a tag folder without a marker (a save cut
short by a crash) is ignored, and deleted before that step is saved again or by the next rotation. DeepSpeed's own
`<part>/latest` file is rewritten in place as soon as that one part is saved, so it is never trusted. Rotation
deletes a marker before its folders, so no marker ever names a half-deleted folder, and it keeps the newest commit.
The controller and every rank must see the same file system under <ckpt_dir> (a DeepSpeed resume needs that too).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

TAG_PATTERN = re.compile(r"^global_step(\d+)$")
COMMIT_DIR = "committed"  # <ckpt_dir>/committed/<tag>.json: one marker per resumable step
SINGLE_PART = "."  # the part name of a checkpoint whose tag folders are in <ckpt_dir> itself


def tag_for_step(step: int) -> str:
    return f"global_step{step}"


@dataclass(frozen=True)
class Commit:
    """A resumable step: every part's tag folder is complete and `state` is the controller's state at that step."""

    step: int
    parts: tuple[str, ...]
    state: dict = field(default_factory=dict)

    @property
    def tag(self) -> str:
        return tag_for_step(self.step)


def list_tags(ckpt_dir: str | Path) -> list[str]:
    """Checkpoint tags in `ckpt_dir`, oldest step first."""
    path = Path(ckpt_dir)
    if not path.is_dir():
        return []
    tags = [(int(m.group(1)), p.name) for p in path.iterdir() if p.is_dir() and (m := TAG_PATTERN.match(p.name))]
    return [name for _, name in sorted(tags)]


def step_of(tag: str) -> int:
    match = TAG_PATTERN.match(tag)
    assert match, tag
    return int(match.group(1))


def marker_path(ckpt_dir: str | Path, step: int) -> Path:
    return Path(ckpt_dir) / COMMIT_DIR / f"{tag_for_step(step)}.json"


def _read_commit(path: Path, ckpt_dir: Path) -> Commit:
    """The commit a marker records; ValueError when it is unreadable or names a part folder that is not there."""
    match = TAG_PATTERN.match(path.stem)
    try:
        data = json.loads(path.read_text())
        step, parts, state = int(data["global_step"]), tuple(data["parts"]), dict(data["state"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"unreadable ({type(err).__name__}: {err})") from None
    if step != int(match.group(1)) or not parts or not all(isinstance(p, str) for p in parts):
        raise ValueError(f"its content does not match its name (step {step}, parts {list(parts)})")
    missing = [p for p in parts if not (ckpt_dir / p / path.stem).is_dir()]
    if missing:
        raise ValueError(f"the folder of part(s) {missing} is missing")
    return Commit(step, parts, state)


def list_commits(ckpt_dir: str | Path) -> list[Commit]:
    """The resumable steps in `ckpt_dir`, oldest first; an invalid marker is skipped with a warning."""
    folder = Path(ckpt_dir) / COMMIT_DIR
    if not folder.is_dir():
        return []
    commits = []
    for path in folder.iterdir():
        if path.suffix != ".json" or not TAG_PATTERN.match(path.stem):
            continue
        try:
            commits.append(_read_commit(path, Path(ckpt_dir)))
        except ValueError as err:
            logger.warning("ignoring the checkpoint commit marker %s: %s", path, err)
    return sorted(commits, key=lambda c: c.step)


def resolve(ckpt_dir: str | Path) -> Commit | None:
    """The newest resumable step in `ckpt_dir`, or None. Tag folders no valid marker names are ignored."""
    commits = list_commits(ckpt_dir)
    newest = commits[-1] if commits else None
    parts = newest.parts if newest else (SINGLE_PART, *(p.name for p in Path(ckpt_dir).glob("*") if p.is_dir()))
    ignored = sorted(
        {
            f"{part}/{tag}"
            for part in parts
            for tag in list_tags(Path(ckpt_dir) / part)
            if newest is None or step_of(tag) > newest.step
        }
    )
    if ignored:
        logger.warning(
            "%s: ignoring %s: no commit marker (a save cut short by a crash, or a folder written without "
            "openppo's commit protocol)",
            ckpt_dir,
            ", ".join(ignored),
        )
    return newest


def begin_save(ckpt_dir: str | Path, step: int, parts: list[str]) -> None:
    """Before the parts of `step` are written: drop that step's marker, then the folders an interrupted save left."""
    ckpt_dir, tag = Path(ckpt_dir), tag_for_step(step)
    marker = marker_path(ckpt_dir, step)
    if marker.exists():
        marker.unlink()
        _fsync_dir(marker.parent)
    for part in parts:
        if (ckpt_dir / part / tag).exists():
            logger.info(
                "removing %s before saving it again (left by an earlier or interrupted run)", ckpt_dir / part / tag
            )
            shutil.rmtree(ckpt_dir / part / tag)


def commit(ckpt_dir: str | Path, step: int, parts: list[str], state: dict) -> Path:
    """Make `step` resumable, once every part's tag folder is written and flushed (`fsync_tree`, by the ranks that
    wrote it): write the marker atomically. Returns the marker's path."""
    ckpt_dir = Path(ckpt_dir)
    path = marker_path(ckpt_dir, step)
    write_json_atomic(path, {"global_step": step, "tag": tag_for_step(step), "parts": list(parts), "state": state})
    return path


def rotate(
    ckpt_dir: str | Path, keep: int, current: int, parts: list[str], max_bytes: float | None = None
) -> list[str]:
    """After committing step `current`: keep that commit and the newest `keep - 1` before it (every one with
    `keep <= 0`), and of those only the newest that fit in `max_bytes` together (--max_ckpt_mem; `current` is
    always kept); delete the other markers (invalid ones, and those of later steps left by an earlier run in this
    folder), then every tag folder of `parts` (or of a part any marker names) that no kept marker names (crash
    leftovers included). Returns the deleted tags."""
    ckpt_dir = Path(ckpt_dir)
    commits = [c for c in list_commits(ckpt_dir) if c.step <= current]
    kept = {c.step for c in (commits[-keep:] if keep > 0 else commits)} | {current}
    if max_bytes is not None:
        used = 0.0
        for step in sorted(kept, reverse=True):  # the newest first
            used += sum(_folder_bytes(ckpt_dir / part / tag_for_step(step)) for part in parts)
            if used > max_bytes and step != current:
                kept.discard(step)
    removed = set()
    folder = ckpt_dir / COMMIT_DIR
    for path in folder.iterdir() if folder.is_dir() else []:
        tag = path.name.split(".")[0]
        if path.name.endswith(".tmp"):  # a marker write cut short
            path.unlink()
        elif TAG_PATTERN.match(tag) and step_of(tag) not in kept:
            path.unlink()
            removed.add(tag)
    _fsync_dir(folder)
    for part in sorted(set(parts) | {p for c in commits for p in c.parts}):
        for tag in list_tags(ckpt_dir / part):
            if step_of(tag) not in kept:
                shutil.rmtree(ckpt_dir / part / tag, ignore_errors=True)
                removed.add(tag)
    return sorted((t for t in removed if TAG_PATTERN.match(t)), key=step_of)


def max_bytes(cfg) -> float | None:
    """--max_ckpt_mem (GiB, as OpenRLHF counts it) in bytes; None without a limit."""
    return None if cfg.max_ckpt_mem is None else cfg.max_ckpt_mem * 2**30


def _folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


HF_PATTERN = re.compile(r"^global_step(\d+)_hf$")


def hf_export_dir(ckpt_dir: str | Path, step: int) -> Path:
    """Where `--save_hf_ckpt` puts the HF folder of `step`: next to its checkpoint, as OpenRLHF does."""
    return Path(ckpt_dir) / f"{tag_for_step(step)}_hf"


def rotate_hf(ckpt_dir: str | Path, keep: int) -> list[str]:
    """Keep the newest `keep` HF folders of `--save_hf_ckpt` in `ckpt_dir` (all with `keep <= 0`); delete the
    others. Returns the deleted folder names."""
    ckpt_dir = Path(ckpt_dir)
    found = sorted(
        (int(m.group(1)), p.name)
        for p in (ckpt_dir.iterdir() if ckpt_dir.is_dir() else [])
        if (m := HF_PATTERN.match(p.name)) and p.is_dir()
    )
    removed = [name for _, name in (found[:-keep] if keep > 0 else [])]
    for name in removed:
        shutil.rmtree(ckpt_dir / name, ignore_errors=True)
    return removed


def write_json_atomic(path: str | Path, data: dict) -> None:
    """Write JSON via a temp file, fsync and rename, so readers (and a crash) never see half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        f.write(json.dumps(data, indent=2, sort_keys=True))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(path: Path) -> None:
    """Persist a folder's entries (a rename, a delete); skipped where the platform cannot open a folder."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def fsync_tree(root: str | Path) -> None:
    """Flush every file under `root` to disk: DeepSpeed writes its files without fsync, and a commit marker must not
    reach the disk before the data it vouches for (a power loss, not only a killed process)."""
    for folder, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(folder))
