"""The driver's handle on the vLLM engines of a run, and the `Sample` each completion becomes.

Generation (`SingleTurn.generate`, ppo/collector.py) deals prompts round-robin over the engines
(`VLLMEngine.generate`), one request per engine, and waits at most `timeout_s`. The pool's `lock` keeps
generation and weight replacement apart: an engine never generates while its weights are being replaced (the
actor group's sync holds the lock), which also makes the engines' prefix cache reset at the end of a sync safe.

With --partial_rollout (`partial=True`) a generation does not hold the lock: each engine gets its requests
(`VLLMEngine.submit`) and is then advanced `PARTIAL_STEPS` decoding steps per call until done (`advance`), so a
sync queues between two calls and lands between two steps; the engine holds its steps while the sync is open.

The pool's `turn` is held for a whole generation, submit to last result, in both modes: an engine runs one batch at a
time, so an evaluation (on the trainer's thread) waits for the rollout producer's batch (--async_train), which a
partial rollout keeps running outside the lock, instead of submitting beside it. A weight sync takes only `lock`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

# Decoding steps per engine call in a partial rollout: the most a weight sync waits for the steps in flight (a
# decoding step of a batch takes milliseconds), against one Ray round trip (under a millisecond) per call.
PARTIAL_STEPS = 8
# How long the end of a run waits for all engines to stop their vLLM processes: each gives vLLM 30 s, then waits up
# to 10 s for the processes vLLM killed to be gone before it removes the files they left in /dev/shm.
SHUTDOWN_WAIT_S = 60.0


@dataclass
class Sample:
    """One generated response, as it comes back from an engine (or an agent episode)."""

    prompt_ids: list[int]
    response_ids: list[int]
    rollout_log_probs: list[float]  # sampled-token log-probs from the engine, one per response token
    finish_reason: str  # "stop" or "length"
    group: int  # index of the prompt; the n samples of one prompt share it and must be consecutive
    label: Any = None
    prompt_text: str = ""
    response_text: str = ""
    policy_version: int = 0  # the oldest weight version that sampled a token of it (for async staleness)
    token_versions: list[int] | None = None  # the weight version that sampled each response token
    action_mask: list[int] | None = None  # per response token; None = all ones (single turn)
    reward: float | None = None
    score: float | None = None
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


class EnginePool:
    """The run's engines (Ray actors of `VLLMEngine`), what each reported at start-up, and the sync lock."""

    def __init__(
        self,
        engines: Sequence[Any],
        infos: Sequence[dict[str, Any]] = (),
        *,
        timeout_s: float = 600.0,
        partial: bool = False,
    ):
        self.engines = list(engines)
        self.infos = list(infos)  # pid, node, log files of each engine (failure reports)
        self.timeout_s = timeout_s
        self.partial = partial
        self.lock = threading.Lock()  # generation vs weight replacement
        self.turn = threading.Lock()  # one generation at a time (taken before `lock`, never after it)

    def __len__(self) -> int:
        return len(self.engines)

    def advance(self, engines: list) -> list:
        """--partial_rollout: the results of `engines` (each with a submitted batch), advancing every unfinished
        one PARTIAL_STEPS steps a call, outside the lock, so that a weight sync may land between two calls."""
        import ray

        deadline = time.monotonic() + self.timeout_s
        results: list = [None] * len(engines)
        while any(r is None for r in results):
            waiting = [i for i, r in enumerate(results) if r is None]
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the engines did not finish generating within {self.timeout_s:.0f} s")
            for i, out in zip(
                waiting, ray.get([engines[i].advance.remote(PARTIAL_STEPS) for i in waiting], timeout=left)
            ):
                results[i] = out
            if all(results[i] is None for i in waiting):
                time.sleep(0.001)  # an open sync holds the steps: let it finish
        return results

    def sleep(self) -> None:
        """Engines free weights and KV cache (vLLM sleep; a no-op on CPU)."""
        import ray

        ray.get([e.sleep.remote() for e in self.engines], timeout=self.timeout_s)

    def wake_up(self, tags: list[str]) -> None:
        import ray

        ray.get([e.wake_up.remote(tags) for e in self.engines], timeout=self.timeout_s)

    def shutdown(self) -> None:
        """Stop every engine's vLLM processes (`VLLMEngine.shutdown`) before the actors are killed, within
        `SHUTDOWN_WAIT_S`. An engine that is dead or does not answer is reported in one line and left to Ray."""
        import ray

        calls = [e.shutdown.remote() for e in self.engines]
        deadline = time.monotonic() + SHUTDOWN_WAIT_S
        for i, call in enumerate(calls):
            try:
                ray.get(call, timeout=max(0.0, deadline - time.monotonic()))
            except Exception as e:  # dead, or stuck: the actor is killed next either way
                logger.warning("vLLM engine %d did not shut down cleanly (%s): Ray kills it", i, type(e).__name__)
