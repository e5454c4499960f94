"""Rewards from a user's Python file (`--remote_rm_url my_reward.py`).

The file defines `reward_func(queries, prompts, labels, **kwargs)` and returns, for a batch, either the rewards
(a list or 1-d tensor of floats, one per query) or a dict {"rewards", "scores" (optional), "extra_logs"
(optional)}; see `openppo.rewards.base.to_result`. `examples/reward_funcs/` has two such files.

Each call runs on a thread of its own and may take `timeout_s` (--reward_func_timeout): a call that never returns
stops the run with an error naming the function and the batch, or with a `default_reward` gives the batch that
reward, instead of hanging the run (its thread is left to it; the next call gets a new one).

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
from openppo.utils.time_limit import CallThread, Late

logger = logging.getLogger(__name__)

FLAG = "--remote_rm_url"
TIMEOUT_FLAG = "--reward_func_timeout"
DEFAULT_TIMEOUT_S = 600.0
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

    def __init__(
        self,
        path: str,
        *,
        default_reward: float | None = None,
        flag: str = FLAG,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ):
        if not timeout_s > 0:
            raise UserError(f"{TIMEOUT_FLAG} must be positive (seconds one reward_func call may take), got {timeout_s}")
        self.path = str(path)
        self.name = f"reward_func in {self.path}"
        self.func = load_reward_func(path, flag)
        self.default_reward = default_reward
        self.timeout_s = timeout_s
        self._thread = CallThread("reward-func")
        self.num_defaulted = 0
        """samples that got `default_reward` because reward_func raised or was late (for the trainer to log)"""

    def score(self, queries: list[str], prompts: list[str], labels: list) -> RewardResult:
        check_inputs(queries, prompts, labels)
        if not queries:
            return RewardResult(rewards=[])
        try:
            output = self._call(queries, prompts, labels)
        except Late:
            late = (
                f"{self.name} did not return within {self.timeout_s:g} s on a batch of {len(queries)} samples "
                f"({TIMEOUT_FLAG}: raise it if the function is slow, or find where it hangs)"
            )
            if self.default_reward is None:
                raise RewardError(f"{late}; first sample: query={_clip(queries[0])}") from None
            return self._defaulted(late, len(queries))
        except Exception as err:
            if self.default_reward is None:
                raise RewardError(self._describe_failure(err, queries, prompts, labels)) from err
            return self._defaulted(f"{self.name} raised {type(err).__name__}: {err}", len(queries))
        return to_result(output, len(queries), self.name)

    def _defaulted(self, why: str, n: int) -> RewardResult:
        self.num_defaulted += n
        logger.warning("%s; using default_reward=%s for the %d samples of this batch", why, self.default_reward, n)
        return RewardResult(rewards=[float(self.default_reward)] * n)

    def _call(self, queries, prompts, labels):
        return self._thread.run(lambda: self.func(list(queries), list(prompts), list(labels)), self.timeout_s)

    def _describe_failure(self, err: Exception, queries, prompts, labels) -> str:
        """The error message: the exception and the first sample that fails alone (or the first sample)."""
        index, failure = 0, err
        if len(queries) > 1:
            for i, triple in enumerate(list(zip(queries, prompts, labels))[:_PROBE_LIMIT]):
                try:
                    self._call(*[[x] for x in triple])
                except Late:
                    break  # a sample hangs on its own: the batch's error stands (probing would wait on each)
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
