"""The reward-source interface: text in, one reward per sample out.

A `RewardSource` scores finished samples given as text: `queries[i]` is the prompt and the response as the policy
saw them (prompt + response), `prompts[i]` the prompt alone, `labels[i]` the data set's label or None. It returns a
`RewardResult` with one finite float per query. Every source checks what it got back with `to_result`, so a
reward function or server that returns the wrong count, a NaN or a string fails at once with the source's name,
instead of surfacing later as a shape error far from the cause.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


class RewardError(RuntimeError):
    """A reward source failed at run time (a reward function raised, a server stayed unreachable)."""


@dataclass
class RewardResult:
    """Per-sample outputs of a reward source (all lists have one entry per query, in query order)."""

    rewards: list[float]
    """what the policy is trained on"""
    scores: list[float] | None = None
    """what dynamic filtering and pass@k read (e.g. 0/1 correctness); None means the rewards"""
    extra_logs: dict[str, list[float]] = field(default_factory=dict)
    """per-sample metrics the trainer averages and logs under their names"""

    def __post_init__(self) -> None:
        if self.scores is None:
            self.scores = list(self.rewards)

    def __len__(self) -> int:
        return len(self.rewards)

    @staticmethod
    def concat(parts: Sequence[RewardResult]) -> RewardResult:
        """The parts one after another; extra logs that some part lacks are dropped (see `dropped_logs`)."""
        common = set.intersection(*(set(p.extra_logs) for p in parts)) if parts else set()
        return RewardResult(
            rewards=[r for p in parts for r in p.rewards],
            scores=[s for p in parts for s in p.scores],
            extra_logs={k: [v for p in parts for v in p.extra_logs[k]] for k in sorted(common)},
        )

    def to_json(self) -> dict[str, Any]:
        return {"rewards": self.rewards, "scores": self.scores, "extra_logs": self.extra_logs}


def dropped_logs(parts: Sequence[RewardResult]) -> set[str]:
    """Extra-log names present in some parts but not all (what `RewardResult.concat` drops)."""
    if not parts:
        return set()
    names = [set(p.extra_logs) for p in parts]
    return set.union(*names) - set.intersection(*names)


class RewardSource(abc.ABC):
    """Something that scores (query, prompt, label) triples; see the module docstring for the contract."""

    name: str = "reward source"
    """how errors and logs refer to this source (a file path, a URL list)"""

    @abc.abstractmethod
    def score(self, queries: list[str], prompts: list[str], labels: list) -> RewardResult:
        """One reward per query; raises `RewardError` when the source fails."""

    def close(self) -> None:  # noqa: B027 (a default: most sources hold nothing to release)
        """Release threads and connections (idempotent)."""


def check_inputs(queries: Sequence, prompts: Sequence, labels: Sequence) -> None:
    """Internal invariant of every `score` call: three lists of the same length."""
    if not (len(queries) == len(prompts) == len(labels)):
        raise ValueError(f"queries, prompts and labels differ in length: {len(queries)}, {len(prompts)}, {len(labels)}")


def _floats(values: Any, what: str, num: int, source: str, *, finite: bool) -> list[float]:
    if hasattr(values, "tolist") and not isinstance(values, (list, tuple)):
        values = values.tolist()  # torch tensors and numpy arrays, without importing either
    if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple)):
        raise RewardError(f"{source}: {what} must be a list of {num} numbers, got {type(values).__name__}")
    if len(values) != num:
        raise RewardError(f"{source}: {what} has {len(values)} values for {num} queries; return one per query")
    out = []
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            if hasattr(v, "item") and not isinstance(v, (list, tuple)):  # 0-dim tensor / numpy scalar
                v = v.item()
            else:
                raise RewardError(f"{source}: {what}[{i}] is {type(v).__name__} {v!r:.80}, not a number")
        v = float(v)
        if finite and not math.isfinite(v):
            raise RewardError(f"{source}: {what}[{i}] is {v}; rewards must be finite")
        out.append(v)
    return out


def to_result(output: Any, num: int, source: str) -> RewardResult:
    """Check and convert what a reward function or server returned.

    Accepted: a list/tuple/tensor/array of `num` numbers (the rewards), a `RewardResult`, or a dict with "rewards"
    and optionally "scores" (same form) and "extra_logs" (name -> `num` numbers, or one number for all samples).
    """
    if isinstance(output, RewardResult):
        output = output.to_json()
    if not isinstance(output, dict):
        return RewardResult(rewards=_floats(output, "rewards", num, source, finite=True))
    if "rewards" not in output:
        raise RewardError(f"{source}: the returned dict has no 'rewards' (keys: {sorted(output)})")
    unknown = set(output) - {"rewards", "scores", "extra_logs"}
    if unknown:
        raise RewardError(
            f"{source}: unknown keys {sorted(unknown)} in the returned dict; expected rewards, scores, extra_logs"
        )
    rewards = _floats(output["rewards"], "rewards", num, source, finite=True)
    scores = output.get("scores")
    scores = rewards if scores is None else _floats(scores, "scores", num, source, finite=True)
    logs = output.get("extra_logs") or {}
    if not isinstance(logs, dict):
        raise RewardError(
            f"{source}: extra_logs must be a dict of name -> per-sample numbers, got {type(logs).__name__}"
        )
    extra = {}
    for key, values in logs.items():
        if isinstance(values, (int, float)) and not isinstance(values, bool):
            values = [values] * num
        extra[str(key)] = _floats(values, f"extra_logs[{key!r}]", num, source, finite=False)
    return RewardResult(rewards=rewards, scores=scores, extra_logs=extra)
