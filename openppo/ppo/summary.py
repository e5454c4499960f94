"""The end-of-run summary: how the reward moved and where the time went."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def _summarized(key: str) -> bool:
    return key.startswith(("timing/", "perf/"))


class RunHistory:
    """What the end-of-run table and advice read from the steps, in memory that does not grow with the run: running
    sums of every `timing/*` and `perf/*` value, the first step's values (the advice leaves out the warm-up), the
    first and last `KEEP` rewards and the first and last response length. A 10k-step run holds what a 20-step
    one does."""

    KEEP = 16

    def __init__(self) -> None:
        self.steps = 0
        self._sums: dict[str, float] = {}
        self._first: dict[str, float] = {}
        self._after_first: set[str] = set()  # keys seen in a step other than the first
        self._rewards_first: list[float] = []
        self._rewards_last: deque[float] = deque(maxlen=self.KEEP)
        self.response_length: tuple[float, float] = (float("nan"), float("nan"))  # first, last

    @classmethod
    def of(cls, steps: Iterable[dict[str, float]]) -> RunHistory:
        history = cls()
        for metrics in steps:
            history.add(metrics)
        return history

    def __len__(self) -> int:
        return self.steps

    def add(self, metrics: dict[str, float]) -> None:
        timed = {k: float(v) for k, v in metrics.items() if _summarized(k)}
        if self.steps == 0:
            self._first = timed
        else:
            self._after_first.update(timed)
        for k, v in timed.items():
            self._sums[k] = self._sums.get(k, 0.0) + v
        self.steps += 1
        reward = float(metrics.get("rollout/reward", float("nan")))
        if len(self._rewards_first) < self.KEEP:
            self._rewards_first.append(reward)
        self._rewards_last.append(reward)
        length = float(metrics.get("response_length", float("nan")))
        self.response_length = (length if self.steps == 1 else self.response_length[0], length)

    def means(self, skip_first: bool = False) -> dict[str, float]:
        """Mean of each timing/perf value over the steps (a step without it counts 0); `skip_first` leaves out the
        first step when there are more."""
        if skip_first and self.steps > 1:
            return {k: (self._sums[k] - self._first.get(k, 0.0)) / (self.steps - 1) for k in self._after_first}
        return {k: v / self.steps for k, v in self._sums.items()} if self.steps else {}

    def rewards(self, window: int) -> tuple[list[float], list[float]]:
        """The first and last `window` (at most KEEP) steps' mean rewards."""
        window = min(window, self.KEEP, self.steps)
        return self._rewards_first[:window], list(self._rewards_last)[len(self._rewards_last) - window :]


def summary_table(history: RunHistory, window: int = 5) -> str:
    """A plain-text table: reward over the first vs last `window` steps, then each stage's mean seconds and share."""
    if not history.steps:
        return "no steps were run"
    first, last = history.rewards(window)
    lines = [
        f"steps: {history.steps}",
        f"reward, mean of first {len(first)} steps: {_mean(first):.3f}",
        f"reward, mean of last {len(last)} steps:  {_mean(last):.3f}",
        f"response length, first -> last step: {history.response_length[0]:.1f} -> {history.response_length[1]:.1f}",
        "",
        f"{'stage':<22}{'s/step':>10}{'share':>9}",
    ]
    all_means = history.means()
    # timing/step is the whole step's wall time, not a stage: it is the total the stages are shares of
    means = {k: v for k, v in all_means.items() if k.startswith("timing/") and k != "timing/step"}
    # --async_train: generation and scoring ran beside the step, on the producer thread
    overlapped = {"timing/generate", "timing/reward"} if "timing/wait_rollout" in means else set()
    staged = sum(v for k, v in means.items() if k not in overlapped)
    has_step = "timing/step" in all_means
    total = (all_means["timing/step"] if has_step else staged) or 1.0
    if has_step and "timing/idle" not in means and total - staged > 0.005 * total:
        means["timing/idle"] = total - staged  # collation, metrics, controller work between the stages
    for key in sorted(means, key=lambda k: -means[k]):
        name = key.split("/", 1)[1] + (" (async)" if key in overlapped else "")
        lines.append(f"{name:<22}{means[key]:>10.2f}{means[key] / total:>8.0%}")
    lines.append(f"{'step':<22}{total:>10.2f}")
    return "\n".join(lines)
