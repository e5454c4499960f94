"""The end-of-run history keeps constant memory yet gives the same numbers as keeping every step."""

from __future__ import annotations

import random

import pytest

from openppo.ppo.reporting import RunHistory


def _steps(n: int, seed: int = 0) -> list[dict[str, float]]:
    rng = random.Random(seed)
    steps = []
    for i in range(n):
        step = {
            "train/reward": rng.random(),
            "train/response_length": float(rng.randint(1, 30)),
            "train/kl": rng.random(),
            "timing/generate": rng.random(),
            "timing/step": 2.0 + rng.random(),
            "perf/driver_rss_gib": 0.6,
        }
        if i % 3 == 0:  # a stage that runs every third step (eval, a checkpoint)
            step["timing/save"] = rng.random()
        if i == 0:
            step["timing/warm_up"] = 5.0  # only in the first step
        steps.append(step)
    return steps


@pytest.mark.parametrize("n", [1, 2, 7, 40])
def test_same_numbers_as_the_full_list(n):
    steps = _steps(n)
    history = RunHistory.of(steps)
    timed = [{k: v for k, v in s.items() if k.startswith(("timing/", "perf/"))} for s in steps]
    keys = {k for s in timed for k in s}
    assert history.means() == pytest.approx({k: sum(s.get(k, 0.0) for s in timed) / n for k in keys})
    rest = timed[1:] if n > 1 else timed
    rest_keys = {k for s in rest for k in s}
    assert history.means(skip_first=True) == pytest.approx(
        {k: sum(s.get(k, 0.0) for s in rest) / len(rest) for k in rest_keys}
    )
    first, last = history.rewards(5)
    assert first == [s["train/reward"] for s in steps[:5]] and last == [s["train/reward"] for s in steps[-5:]]
    assert history.response_length == (steps[0]["train/response_length"], steps[-1]["train/response_length"])


def test_memory_does_not_grow_with_steps():
    def size(h: RunHistory) -> int:  # values held, whatever the containers' spare capacity
        return sum(len(x) for x in (h._sums, h._first, h._after_first, h._rewards_first, h._rewards_last))

    history = RunHistory.of(_steps(50))
    after_50 = size(history)
    for step in _steps(5001, seed=1)[1:]:  # the same keys as before
        history.add(step)
    assert history.steps == 5050 and size(history) == after_50
