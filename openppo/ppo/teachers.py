"""On-policy distillation's teachers: their names, which prompt goes to which, and the step's distillation math.

`--teacher_pretrain [NAME=]PATH ...` gives one or more teachers. Each runs as a forward-only group of its own
(`teacher0`, `teacher1`, ...: `TeacherWorker` ranks, --teacher_num_nodes x --teacher_num_gpus_per_node each), so a
teacher holds only its own weights and sees only its own prompts' rows. With several, `--teacher_key` names the
prompt column that routes each prompt to a teacher, by NAME (or folder name) or position. The routing is fixed per
dataset row at start-up, so a bad value fails before anything starts, naming the row.

Why DeepSpeed forward ranks and not a vLLM engine's prompt log-probs (docs/algorithms.md has the measurement,
`bench/teacher_logprobs.py`): the advantage is a difference of teacher and student log-probs, so both come from one
code path (the reference's: the same sharding, offload and log-softmax as the student's), and the forward's LM head
skips the prompt, where vLLM scores every position and returns each as a Python dict.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from openppo.algorithms import distillation_advantages, teacher_kl
from openppo.errors import UserError


@dataclass(frozen=True)
class Teacher:
    name: str  # in metrics (train/teacher_kl/<name>) and in --teacher_key values
    path: str

    @staticmethod
    def role(index: int) -> str:
        """The teacher's model group (a plan role, a worker-group name)."""
        return f"teacher{index}"


def parse_teachers(specs: Sequence[str]) -> list[Teacher]:
    """`--teacher_pretrain` values -> teachers; a name given twice is refused (routing and metrics use it)."""
    teachers = []
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep:  # a bare folder: named by its last component
            name, path = Path(spec.rstrip("/")).name or spec, spec
        if not name or not path:
            raise UserError(f"--teacher_pretrain {spec!r}: give NAME=PATH or a folder PATH")
        teachers.append(Teacher(name, path))
    names = [t.name for t in teachers]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise UserError(
            f"--teacher_pretrain: two teachers are named {dup!r}; name them apart with NAME=PATH (NAME is what "
            f"--teacher_key values and the train/teacher_kl/<NAME> metrics use)"
        )
    return teachers


def route(values: Sequence[Any] | None, teachers: Sequence[Teacher], key: str | None) -> list[int] | None:
    """The teacher of each dataset row: `values` is the --teacher_key column (None without the flag). None when
    every row goes to the one teacher. A value is a teacher's name or its position (0, 1, ...)."""
    if len(teachers) == 1:
        return None
    if values is None:
        raise UserError(
            f"--teacher_pretrain gives {len(teachers)} teachers: add --teacher_key COLUMN, the prompt column naming "
            f"each prompt's teacher ({', '.join(t.name for t in teachers)})"
        )
    index = {t.name: i for i, t in enumerate(teachers)}
    index.update({str(i): i for i in range(len(teachers))})
    out = []
    for row, value in enumerate(values):
        i = index.get(str(value).strip())
        if i is None:
            raise UserError(
                f"--teacher_key {key}: row {row} names teacher {value!r}, which is not one of "
                f"{', '.join(t.name for t in teachers)} (or 0..{len(teachers) - 1})"
            )
        out.append(i)
    return out


def teacher_rows(groups: torch.Tensor, routes: Sequence[int] | None, teachers: int) -> list[torch.Tensor]:
    """Per teacher, the batch rows it scores (`groups` [B]: each row's dataset row, `Sample.group`)."""
    if routes is None:
        return [torch.arange(len(groups))]
    of_row = torch.tensor([routes[int(g)] for g in groups], dtype=torch.long)
    return [torch.nonzero(of_row == i).flatten() for i in range(teachers)]


def rows_for_ranks(rows: torch.Tensor, ranks: int) -> torch.Tensor:
    """`rows`, repeated until each of `ranks` data-parallel ranks gets one: validation makes the whole batch feed
    every rank, but one teacher's share of it may not. The forward's first len(rows) results are the rows'."""
    return rows.repeat(-(-ranks // len(rows)))[: max(len(rows), ranks)]


def distill_step(
    teacher_lp: torch.Tensor,
    student_lp: torch.Tensor,
    mask: torch.Tensor,
    task_advantages: torch.Tensor,
    task_coef: float,
    rows: Sequence[torch.Tensor],
    names: Sequence[str],
) -> tuple[torch.Tensor, dict[str, float]]:
    """The step's advantages [B, T-1] (`distillation_advantages`: log pi_T - log pi_S + coef x the task's) and its
    metrics: train/teacher_kl over every row, and train/teacher_kl/<name> over each teacher's rows when there are
    several (the reverse KL estimate on the student's own samples, k1)."""
    advantages = distillation_advantages(
        teacher_lp, student_lp, mask, task_advantages=task_advantages, task_coef=task_coef
    )
    metrics = {"train/teacher_kl": teacher_kl(teacher_lp, student_lp, mask).item()}
    if len(names) > 1:
        for name, r in zip(names, rows):
            if len(r):
                metrics[f"train/teacher_kl/{name}"] = teacher_kl(teacher_lp[r], student_lp[r], mask[r]).item()
    return advantages, metrics


def check_teacher_tokenizers(student: str, teachers: Sequence[Teacher]) -> None:
    """Refuse a teacher whose tokenizer reads a token id otherwise than the student's: its log-prob of a sampled id
    would be of another token (`models.hf.vocabulary_difference`). No cross-tokenizer method is implemented."""
    from openppo.models.hf import load_tokenizer, vocabulary_difference

    ours = load_tokenizer(student)
    for t in teachers:
        difference = vocabulary_difference(ours, load_tokenizer(t.path))
        if difference is not None:
            raise UserError(
                f"--teacher_pretrain {t.path}: its tokenizer is not the student's (--pretrain): {difference}; a "
                f"teacher scores the student's token ids, so both must share one tokenizer"
            )
