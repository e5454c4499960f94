"""The async rollout producer: batches ahead of training, bounded staleness, errors and timeouts surface."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from openppo.ppo.collector import Rollout, RolloutProducer, staleness
from openppo.rollout.pool import Sample


def _sample(version: int) -> Sample:
    return Sample(
        prompt_ids=[1], response_ids=[2], rollout_log_probs=[0.0], finish_reason="stop", group=0, policy_version=version
    )


def _rollout(version: int) -> Rollout:
    return Rollout([_sample(version)], torch.zeros(1), {}, [0], {"cursor": 1, "per_episode": 1})


@pytest.mark.parametrize("ahead", [1, 2])
def test_batches_start_at_most_ahead_versions_before_training(ahead):
    version = {"now": 0}  # weight version = finished steps (each step ends with a sync)
    lock = threading.Lock()

    def produce():
        with lock:
            v = version["now"]
        time.sleep(0.01)
        return _rollout(v)

    steps = 6
    producer = RolloutProducer(produce, ahead=ahead, limit=steps, timeout_s=10)
    producer.start()
    lags = []
    for done in range(steps):
        rollout, _ = producer.get()
        lags.append(staleness(rollout.samples, version["now"])["rollout/staleness_max"])
        # training: let the producer run ahead as far as it may (batches done + 1 + ahead started and queued)
        allowed = min(steps, done + 1 + ahead)
        deadline = time.monotonic() + 10
        while (
            producer._started < allowed or producer._ready.qsize() < allowed - done - 1
        ) and time.monotonic() < deadline:
            time.sleep(0.005)
        with lock:
            version["now"] += 1
        producer.step_done()
    producer.stop()
    assert max(lags) == ahead  # it does run ahead, by exactly the bound
    assert lags[0] == 0
    assert producer._started == steps  # nothing generated beyond the last step


def test_producer_error_and_timeout_reach_the_trainer():
    def fail():
        raise ValueError("reward server down")

    producer = RolloutProducer(fail, ahead=1, limit=3, timeout_s=5)
    producer.start()
    with pytest.raises(RuntimeError, match="rollout generation failed: reward server down"):
        producer.get()
    producer.stop()

    stuck = RolloutProducer(lambda: time.sleep(30), ahead=1, limit=1, timeout_s=0.2)
    stuck.start()
    with pytest.raises(TimeoutError, match="no rollout batch within"):
        stuck.get()


def test_staleness_metrics():
    out = staleness([_sample(3), _sample(2), _sample(3)], version=4)
    assert out == {"rollout/staleness_mean": pytest.approx(4 / 3), "rollout/staleness_max": 2.0}
