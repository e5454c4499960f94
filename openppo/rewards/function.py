"""Rewards from a user's Python file (`--remote_rm_url my_reward.py`).

The file defines `reward_func(queries, prompts, labels, **kwargs)` and returns, for a batch, either the rewards
(a list or 1-d tensor of floats, one per query) or a dict {"rewards", "scores" (optional), "extra_logs"
(optional)}; see `openppo.rewards.base.to_result`. `examples/reward_funcs/` has two such files.

When `reward_func` raises, the error names the first sample that fails on its own (found by scoring the samples
one at a time, only on this error path), so the user sees which input broke their function. With a
`default_reward` the batch gets that value instead and a warning says how many samples it replaced.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from openppo.errors import UserError
from openppo.rewards.base import RewardError, RewardResult, RewardSource, check_inputs, to_result
from openppo.utils.imports import import_file

logger = logging.getLogger(__name__)

FLAG = "--remote_rm_url"
_PROBE_LIMIT = 256  # samples re-scored one by one to find the failing one (error path only)


def _clip(text: object, limit: int = 200) -> str:
    text = repr(text)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} chars)"


def load_reward_func(path: str | Path, flag: str = FLAG) -> Callable:
    """Import `path` as a module of its own and return its `reward_func`; UserError naming `flag` otherwise."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise UserError(
            f"{flag}: reward function file {path} not found; pass an existing .py file that "
            f"defines reward_func(queries, prompts, labels, **kwargs)"
        )
    module = import_file(p, flag, "openppo_reward_func_")
    func = getattr(module, "reward_func", None)
    if func is None:
        raise UserError(
            f"{flag}: {path} defines no reward_func; add "
            f"def reward_func(queries, prompts, labels, **kwargs) returning one float per query"
        )
    if not callable(func):
        raise UserError(f"{flag}: reward_func in {path} is a {type(func).__name__}, not a function")
    return func


class FunctionReward(RewardSource):
    """Calls `reward_func` from a .py file on each batch, in this process."""

    def __init__(self, path: str, *, default_reward: float | None = None, flag: str = FLAG):
        self.path = str(path)
        self.name = f"reward_func in {self.path}"
        self.func = load_reward_func(path, flag)
        self.default_reward = default_reward
        self.num_defaulted = 0
        """samples that got `default_reward` because reward_func raised (for the trainer to log)"""

    def score(self, queries: list[str], prompts: list[str], labels: list) -> RewardResult:
        check_inputs(queries, prompts, labels)
        if not queries:
            return RewardResult(rewards=[])
        try:
            output = self.func(list(queries), list(prompts), list(labels))
        except Exception as err:
            if self.default_reward is not None:
                self.num_defaulted += len(queries)
                logger.warning(
                    "%s raised %s: %s; using default_reward=%s for the %d samples of this batch",
                    self.name,
                    type(err).__name__,
                    err,
                    self.default_reward,
                    len(queries),
                )
                return RewardResult(rewards=[float(self.default_reward)] * len(queries))
            raise RewardError(self._describe_failure(err, queries, prompts, labels)) from err
        return to_result(output, len(queries), self.name)

    def _describe_failure(self, err: Exception, queries, prompts, labels) -> str:
        """The error message: the exception and the first sample that fails alone (or the first sample)."""
        index, failure = 0, err
        if len(queries) > 1:
            for i, triple in enumerate(list(zip(queries, prompts, labels))[:_PROBE_LIMIT]):
                try:
                    self.func(*[[x] for x in triple])
                except Exception as single_err:
                    index, failure = i, single_err
                    break
            else:
                index = None  # every sample passes alone: the batch as a whole is the problem
        head = f"{self.name} raised {type(err).__name__}: {err}"
        if index is None:
            return (
                f"{head} on a batch of {len(queries)} samples, though no sample (of the first "
                f"{min(len(queries), _PROBE_LIMIT)}) fails alone; "
                f"first sample: query={_clip(queries[0])} label={_clip(labels[0], 80)}"
            )
        return (
            f"{head} (batch of {len(queries)}); first failing sample #{index}: query={_clip(queries[index])} "
            f"label={_clip(labels[index], 80)}" + ("" if failure is err else f" -> {type(failure).__name__}: {failure}")
        )
