"""DeepSpeed ZeRO-3 ranks inside Ray actors: two actors of a WorkerGroup form one world and train the tiny model."""

from __future__ import annotations

import time

import pytest
import ray

from openppo.distributed.worker_group import WorkerGroup, WorkerGroupError
from tests import ray_cluster
from tests.distributed.workers import CollectiveWorker, TrainWorker
from tests.model_cache import tiny_model_dir


@pytest.fixture(scope="module")
def ray_cpu():
    ray_cluster.connect()
    yield
    ray.shutdown()


@pytest.mark.slow
def test_zero3_ranks_train_in_lockstep(ray_cpu):
    model_dir = str(tiny_model_dir())
    t0 = time.monotonic()
    group = WorkerGroup(TrainWorker, 2, name="policy", num_cpus_per_worker=1, timeout_s=240)
    started = time.monotonic() - t0
    try:
        results = group.run("train", model_dir, 2)
    finally:
        group.shutdown()
    print(
        f"group start {started:.1f} s; per rank: "
        + "; ".join(
            f"rank {r['rank']}: init_process_group {r['init_process_group_s']:.1f} s, engine "
            f"{r['build_engine_s']:.1f} s, 2 steps {r['train_s']:.1f} s"
            for r in results
        )
    )
    assert [(r["rank"], r["world_size"]) for r in results] == [(0, 2), (1, 2)]
    assert all(r["zero3_partitioned"] for r in results)
    losses = [r["losses"] for r in results]
    assert losses[0] == losses[1]  # same batch, same sharded weights: bit-identical on both ranks
    assert losses[0][1] < losses[0][0]


@pytest.mark.slow
def test_rank_dying_before_a_collective_fails_the_call_at_once(ray_cpu):
    """Rank 0 blocks in an all-reduce that rank 1 never joins (it exits): the driver hears of it at once, not after
    the 300 s distributed timeout, and rank 1, the root cause, is the rank named."""
    group = WorkerGroup(CollectiveWorker, 2, name="allreduce", timeout_s=120)
    t0 = time.monotonic()
    with pytest.raises(WorkerGroupError) as err:
        group.run("all_reduce_after_exit", 1)
    elapsed = time.monotonic() - t0
    print(f"death inside a gloo world reported after {elapsed:.1f} s (process-group start included)")
    assert elapsed < 60, elapsed
    assert err.value.rank == 1 and "died in 'all_reduce_after_exit'" in str(err.value)
    assert "rank 1 exiting before the all-reduce" in err.value.log_tail
