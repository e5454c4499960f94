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

A dead engine (its process killed, or one of vLLM's processes dead under it: `VLLMEngine._watch_vllm_processes`)
is replaced, up to `max_restarts` times in a run (--max_engine_restarts): a new actor with the same resources
(`start`, from ppo/launch.py: in the hybrid engine the same placement-group bundle), then `on_replace`, which the
trainer sets to connect the engines anew and sync them to the current weights, as the current version. A generation
that lost an engine sends that engine's requests again to its replacement (the requests the others answered are
kept), so each sample is generated once. `epoch` counts replacements: the weight sync reconnects when it changed.
Past the bound, or when the replacement cannot start, the run stops with the error naming the dead engine.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from openppo.errors import headline

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
    # the weight version that sampled each trained token (the action mask's 1s, in order), where known: the engine's
    # tags (--partial_rollout), or the version the pool held through the generation (`EnginePool.run`)
    token_versions: list[int] | None = None
    action_mask: list[int] | None = None  # per response token; None = all ones (single turn)
    reward: float | None = None
    score: float | None = None
    extra: dict[str, float] = field(default_factory=dict)
    # an agent episode served through the OpenAI endpoint: its training rows, one per segment of calls whose prompts
    # extend each other (`openppo.agents.transcript`); prompt_ids/response_ids are then its last call's, for scoring
    segments: list[Sample] | None = None
    dropped: str | None = None  # why the episode cannot be trained on (its agent raised or ran out of time)
    images: list[Any] | None = None  # an image prompt's images (`openppo.utils.images` references), in order

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


class EnginePool:
    """The run's engines (Ray actors of `VLLMEngine`), what each reported at start-up, the sync lock, and the
    replacement of dead engines (module docstring)."""

    def __init__(
        self,
        engines: Sequence[Any],
        infos: Sequence[dict[str, Any]] = (),
        *,
        timeout_s: float = 600.0,
        partial: bool = False,
        start: Callable[[int], Any] | None = None,
        max_restarts: int = 0,
    ):
        self.engines = list(engines)
        self.infos = list(infos)  # pid, node, log files of each engine (failure reports)
        self.timeout_s = timeout_s
        self.partial = partial
        # generation vs weight replacement; reentrant, so that the trainer's sync can reconnect inside it
        self.lock = threading.RLock()
        self.turn = threading.Lock()  # one generation at a time (taken before `lock`, never after it)
        self.start = start  # engine i -> a new actor with engine i's options (None: dead engines stop the run)
        self.max_restarts = max_restarts
        self.restarts = 0
        self.epoch = 0  # replacements so far: the weight-sync connection is rebuilt when it moves
        self.stale: set[int] = set()  # replaced engines that no weight sync has reached yet
        self.version = 0  # the weight version the engines hold: set by each sync, under `lock`
        self.on_replace: Callable[[], None] | None = None  # connects and syncs replaced engines (the trainer)

    def __len__(self) -> int:
        return len(self.engines)

    # -- generation ------------------------------------------------------------------------------------------------

    def run(self, requests: dict[int, dict[str, Any]]) -> dict[int, list]:
        """Engine e's result of `VLLMEngine.generate(**requests[e])`, for each e, waiting at most `timeout_s` per
        round. Under `turn`; without --partial_rollout under `lock` too, so no weight sync lands mid-generation, and
        each completion gets `version`, the weight version that generated it (with --partial_rollout the engine tags
        every token instead: `versions`); with it, each engine gets its requests (`VLLMEngine.submit`) and is
        `advance`d outside the lock. An engine that dies meanwhile is replaced (`recover`) and gets its requests
        again."""
        results: dict[int, list] = {}
        todo = dict(requests)
        noticed: dict[int, float] = {}  # engine -> when its death was noticed
        with self.turn:
            while todo:
                done, dead = self._run_once(todo)
                results.update(done)
                for e in sorted(noticed.keys() & done.keys()):
                    logger.info(
                        "vLLM engine %d: the prompts it lost were generated again, %.1f s after its death was noticed",
                        e,
                        time.monotonic() - noticed.pop(e),
                    )
                todo = {e: todo[e] for e in dead}
                if dead:
                    for e in dead:
                        noticed.setdefault(e, time.monotonic())
                    self.recover(dead, "by a generation")
        return results

    def _run_once(self, requests: dict[int, dict[str, Any]]) -> tuple[dict[int, Any], dict[int, Exception]]:
        deadline = time.monotonic() + self.timeout_s
        with self.lock:
            call = "submit" if self.partial else "generate"
            refs = {e: getattr(self.engines[e], call).remote(**request) for e, request in requests.items()}
            if not self.partial:
                done, dead = self._gather(refs, deadline)
                # (read under the lock that kept every sync out: a multi-turn episode's calls can straddle syncs)
                for prompts in done.values():
                    for completions in prompts:
                        for c in completions:
                            c["version"] = self.version
                return done, dead
        # --partial_rollout: outside the lock, a weight sync may land between two advances
        submitted, dead = self._gather(refs, deadline)
        done, died = self.advance(list(submitted))
        return done, {**dead, **died}

    def _gather(self, refs: dict[int, Any], deadline: float) -> tuple[dict[int, Any], dict[int, Exception]]:
        """({engine: result}, {engine: Ray's error} of the engines that died); any other failure raises."""
        import ray

        ray.wait(list(refs.values()), num_returns=len(refs), timeout=max(0.0, deadline - time.monotonic()))
        done, dead = {}, {}
        for e, ref in refs.items():
            try:
                done[e] = ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
            except ray.exceptions.RayActorError as died:
                dead[e] = died
            except ray.exceptions.GetTimeoutError:
                raise TimeoutError(
                    f"vLLM engine {e} did not finish generating within {self.timeout_s:.0f} s (--dist_timeout)"
                ) from None
        return done, dead

    def advance(self, indices: list[int]) -> tuple[dict[int, list], dict[int, Exception]]:
        """--partial_rollout: the results of engines `indices` (each with a submitted batch), advancing every
        unfinished one PARTIAL_STEPS steps a call, outside the lock, so that a weight sync may land between two
        calls; and the Ray errors of those that died meanwhile."""
        deadline = time.monotonic() + self.timeout_s
        results: dict[int, list] = {}
        dead: dict[int, Exception] = {}
        while waiting := [e for e in indices if e not in results and e not in dead]:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"the engines did not finish generating within {self.timeout_s:.0f} s")
            done, died = self._gather({e: self.engines[e].advance.remote(PARTIAL_STEPS) for e in waiting}, deadline)
            dead.update(died)
            results.update({e: out for e, out in done.items() if out is not None})
            if not any(out is not None for out in done.values()):
                time.sleep(0.001)  # an open sync holds the steps: let it finish
        return results, dead

    # -- dead engines ------------------------------------------------------------------------------------------------

    def recover(self, dead: dict[int, Exception], during: str) -> None:
        """Replace the `dead` engines (`replace`), then bring them to the current weights (`on_replace`)."""
        self.replace(dead, during)
        if self.on_replace is None:
            raise RuntimeError("vLLM engines were replaced, but nothing syncs their weights (set on_replace)")
        self.on_replace()

    def replace_dead(self, during: str) -> bool:
        """Replace the engines that are dead now (asked all at once, bounded); whether there were any."""
        from openppo.distributed.logs import dead_actors

        with self.lock:  # (probed under the lock: what it finds dead is dead still)
            dead = dead_actors(self.engines)
            for e in sorted(dead):
                self._replace_one(e, dead[e], during)
        return bool(dead)

    def replace(self, dead: dict[int, Exception], during: str) -> None:
        """Start a new engine in place of each dead one, with its options and resources, and wait until it is
        ready. Past --max_engine_restarts, without a way to start engines, or when the new engine cannot start: the
        error that stops the run, naming the dead engine.

        Under `lock`, and only for the engines still dead once it is held: the rollout thread (--async_train) and
        the trainer's probe before a sync can find the same death, and it is replaced once."""
        from openppo.distributed.logs import dead_actors

        with self.lock:
            still = dead_actors([self.engines[e] for e in sorted(dead)])
            for i, e in enumerate(sorted(dead)):
                if i in still:
                    self._replace_one(e, dead[e], during)
                else:
                    logger.debug("vLLM engine %d was replaced already", e)

    def _replace_one(self, e: int, error: Exception, during: str) -> None:
        import ray

        from openppo.distributed.logs import actor_infos, died_error

        info = self.infos[e] if e < len(self.infos) else {}
        if self.start is None or self.restarts >= self.max_restarts:
            why = f" (--max_engine_restarts {self.max_restarts}: {self.restarts} restart(s) used)"
            raise died_error("vLLM engine", e, info, error, why if self.start is not None else "")
        self.restarts += 1
        cause = headline(error)
        logger.warning(
            "vLLM engine %d (pid %s on %s) died (noticed %s: %s); starting a new one on the same resources "
            "(restart %d of at most %d)",
            e,
            info.get("pid"),
            info.get("node_ip"),
            during,
            cause,
            self.restarts,
            self.max_restarts,
        )
        ray.kill(self.engines[e], no_restart=True)  # (dead already: frees its resources for the new one now)
        began = time.monotonic()
        try:
            engine = self.start(e)
            ray.get(engine.ready.remote(), timeout=self.timeout_s)
            (new_info,) = actor_infos([engine], self.timeout_s)
        except Exception as failed:
            raise died_error(
                "vLLM engine",
                e,
                info,
                error,
                f" (its replacement did not start: {type(failed).__name__}: {headline(failed, '')})",
            ) from failed
        self.engines[e], self.infos[e] = engine, new_info
        self.stale.add(e)
        self.epoch += 1
        logger.warning(
            "vLLM engine %d: restarted in %.1f s, pid %s on %s (actor %s)",
            e,
            time.monotonic() - began,
            new_info["pid"],
            new_info["node_ip"],
            new_info["actor_id"],
        )

    # -- memory ------------------------------------------------------------------------------------------------------

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
