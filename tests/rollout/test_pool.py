"""EnginePool's replacement of dead engines, on real Ray actors that die for real (`ray.kill`).

What is under test is the pool's bookkeeping: which requests go again and where, the bound, the errors, the hook. The
actors here answer `generate` with where they ran instead of running vLLM, so that each case takes a second rather
than the 20 s of a vLLM start-up; tests/ppo/test_engine_death.py and tests/ppo/test_two_nodes.py run the same code
with real engines killed mid-generation."""

from __future__ import annotations

import os
import time

import pytest
import ray

from openppo.distributed.logs import ActorDiedError, actor_infos, actor_location
from openppo.rollout.pool import EnginePool
from tests import ray_cluster

HANG_S = 300


class Answering:
    """The part of `VLLMEngine`'s interface the pool calls: `generate`, `ready`, `info`."""

    def generate(self, prompt_token_ids: list[list[int]], **request) -> list[list[dict]]:
        return [[{"prompt": prompt, "pid": os.getpid(), "n": request["n"]}] for prompt in prompt_token_ids]

    def ready(self) -> bool:
        return True

    def info(self) -> dict:
        return actor_location()


@pytest.fixture(scope="module")
def cluster():
    ray_cluster.connect()
    yield
    ray.shutdown()


def _pool(size: int, *, max_restarts: int, start=None) -> tuple[EnginePool, list[int]]:
    actor = ray.remote(num_cpus=0)(Answering)
    engines = [actor.remote() for _ in range(size)]
    started: list[int] = []

    def restart(i: int):
        started.append(i)
        return actor.remote()

    # a bound on a hang, not on speed: a replacement actor took over 60 s to start on a loaded 2-core AVX2 box in
    # the suite (7-8 s alone)
    pool = EnginePool(
        engines, actor_infos(engines, HANG_S), timeout_s=HANG_S, start=start or restart, max_restarts=max_restarts
    )
    return pool, started


def _kill(pool: EnginePool, i: int) -> None:
    """Kill engine i and wait until Ray reports it dead (`ray.kill` takes effect a moment later)."""
    ray.kill(pool.engines[i], no_restart=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            ray.get(pool.engines[i].ready.remote(), timeout=30)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.05)
    pytest.fail(f"engine {i} still answers 30 s after ray.kill")


def test_a_dead_engines_requests_go_to_its_replacement_and_the_others_are_kept(cluster):
    pool, started = _pool(2, max_restarts=1)
    survivor = pool.infos[0]["pid"]
    replaced: list[set] = []
    pool.on_replace = lambda: replaced.append(set(pool.stale))
    _kill(pool, 1)
    results = pool.run({0: {"prompt_token_ids": [[1], [3]], "n": 2}, 1: {"prompt_token_ids": [[2]], "n": 2}})
    assert started == [1] and replaced == [{1}]  # one new engine, then one sync of it
    assert [r[0]["prompt"] for r in results[0]] == [[1], [3]] and results[0][0][0]["pid"] == survivor
    assert results[1] == [[{"prompt": [2], "pid": pool.infos[1]["pid"], "n": 2, "version": 0}]]  # by the new engine
    assert (pool.restarts, pool.epoch, pool.stale) == (1, 1, {1})


def test_each_completion_carries_the_weights_version_held_through_its_generation(cluster):
    pool, _ = _pool(2, max_restarts=0)
    pool.version = 3  # as the actor group's sync sets it, under the lock
    results = pool.run({0: {"prompt_token_ids": [[1], [3]], "n": 1}, 1: {"prompt_token_ids": [[2]], "n": 1}})
    assert [c["version"] for e in (0, 1) for prompt in results[e] for c in prompt] == [3, 3, 3]


def test_past_the_bound_the_run_stops_naming_the_engine(cluster):
    pool, started = _pool(1, max_restarts=0)
    pid = pool.infos[0]["pid"]
    _kill(pool, 0)
    with pytest.raises(ActorDiedError) as err:
        pool.run({0: {"prompt_token_ids": [[1]], "n": 1}})
    first = str(err.value).splitlines()[0]
    assert first.startswith(f"vLLM engine 0 (actor {pool.infos[0]['actor_id']}, pid {pid} on ")
    assert "died; the run was stopped (--max_engine_restarts 0: 0 restart(s) used)" in first
    assert started == []


def test_a_replacement_that_cannot_start_stops_the_run(cluster):
    def no_room(i: int):
        raise RuntimeError("no resources for the new engine")

    pool, _ = _pool(1, max_restarts=3, start=no_room)
    _kill(pool, 0)
    with pytest.raises(ActorDiedError, match="its replacement did not start: RuntimeError: no resources"):
        pool.run({0: {"prompt_token_ids": [[1]], "n": 1}})


def test_the_probe_before_a_sync_replaces_an_idle_dead_engine(cluster):
    pool, started = _pool(2, max_restarts=2)
    assert not pool.replace_dead("idle")
    _kill(pool, 0)
    assert pool.replace_dead("idle") and started == [0] and pool.stale == {0}
    assert ray.get(pool.engines[0].ready.remote(), timeout=30)
