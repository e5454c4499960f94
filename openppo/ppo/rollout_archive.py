"""--rollout_dump_dir and --rollout_replay_dir (Molt's --train.rollout_dump_dir / rollout_replay_dir): keep each
step's rollout batch, and train on kept batches again instead of generating.

A dumping run writes the batch that trains step N, as collected (samples with their tokens, engine log-probs and
weight versions, rewards, the batch's rollout metrics, its data position), to DIR/rollout_step{N}.pt. A replaying
run loads DIR/rollout_step{N}.pt for its step N and generates nothing; it ends at the first step without a file.
Everything after the rollout runs as it did: the trainer's forwards, the update, the weight sync to the engines
(which still start), the checkpoints. From the same start and seed a replayed step repeats the dumped one (the e2e
test compares them), so a step that went wrong can be run again in isolation, under a debugger or a profiler.

The files are pickles (torch.save of dataclasses): replay only directories you wrote.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch

from openppo.errors import UserError
from openppo.ppo.collector import Rollout

logger = logging.getLogger(__name__)

NAME = "rollout_step{}.pt"
Collect = Callable[[], "Rollout | None"]


def check_replay_dir(directory: str, flag: str = "--rollout_replay_dir") -> None:
    """A one-line UserError, before anything starts, when `directory` holds no dumped batch."""
    path = Path(directory).expanduser()
    if not path.is_dir():
        raise UserError(f"{flag} {directory}: no such directory; pass the --rollout_dump_dir of an earlier run")
    if not any(path.glob(NAME.format("*"))):
        raise UserError(
            f"{flag} {directory}: no {NAME.format('N')} in it; pass the --rollout_dump_dir of an earlier run"
        )


def dumping(collect: Collect, directory: str, first_step: int) -> Collect:
    """`collect`, saving each batch it returns for step `first_step`, then the next, ... (written whole: a file
    that exists is complete)."""
    out = Path(directory).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    step = first_step

    def collect_and_dump() -> Rollout | None:
        nonlocal step
        rollout = collect()
        if rollout is not None:
            path = out / NAME.format(step)
            partial = path.with_suffix(".pt.partial")
            torch.save(rollout, partial)
            os.replace(partial, path)
            logger.info("--rollout_dump_dir: step %d's %d samples saved to %s", step, len(rollout.samples), path)
            step += 1
        return rollout

    return collect_and_dump


def replaying(directory: str, first_step: int) -> Collect:
    """Batches loaded for step `first_step`, then the next, ...; None (the run ends) at the first step without one."""
    folder = Path(directory).expanduser()
    step = first_step

    def load() -> Rollout | None:
        nonlocal step
        path = folder / NAME.format(step)
        if not path.is_file():
            logger.info("--rollout_replay_dir: no %s, the replay ends", path)
            return None
        rollout = torch.load(path, weights_only=False)  # (dataclasses: module doc)
        if not isinstance(rollout, Rollout):
            raise UserError(f"--rollout_replay_dir: {path} is not a batch that --rollout_dump_dir saved")
        logger.info("--rollout_replay_dir: step %d trains on the %d samples of %s", step, len(rollout.samples), path)
        rollout.timing = {}  # (the dumping run's generation took its time there, none here)
        step += 1
        return rollout

    return load
