"""Placement on GPUs, tested on CPU: Ray accepts `num_gpus=2` on a box without any and hands out their ids.

No DeepSpeed here (torch has no CUDA); only placement, colocation and the env each rank gets.
"""

from __future__ import annotations

import pytest
import ray

from openppo.distributed.placement import colocated_fraction, device_resources, make_placement_group
from openppo.distributed.worker_group import WorkerGroup
from tests.distributed.workers import ProbeWorker


@pytest.fixture(scope="module")
def ray_fake_gpus():
    ray.init(address="local", num_cpus=4, num_gpus=2, include_dashboard=False, logging_level="warning")
    yield
    ray.shutdown()


def test_device_resources_counts_gpus(ray_fake_gpus):
    assert device_resources() == (True, 2)


def test_one_gpu_per_rank(ray_fake_gpus):
    with WorkerGroup(ProbeWorker, 2, num_gpus_per_worker=1, name="gpu", timeout_s=60) as group:
        envs = group.run("env")
    # Ray gives each actor its own device and hides the other: every rank's device is cuda:0, hence LOCAL_RANK=0.
    assert sorted(e["CUDA_VISIBLE_DEVICES"] for e in envs) == ["0", "1"]
    assert [e["RANK"] for e in envs] == ["0", "1"]
    assert {e["LOCAL_RANK"] for e in envs} == {"0"}
    assert {(e["MASTER_ADDR"], e["MASTER_PORT"]) for e in envs} == {(group.master_addr, str(group.master_port))}
    assert {e["OMP_NUM_THREADS"] for e in envs} == {"1"}


def test_colocated_groups_share_each_gpu(ray_fake_gpus):
    """Policy and reference rank i share the GPU of bundle i, half each (the `colocate_actor_ref` layout)."""
    pg = make_placement_group(2, cpus_per_bundle=1, gpus_per_bundle=1, timeout_s=30, name="actor-ref")
    share = colocated_fraction(2)
    groups = []
    try:
        for name in ("policy", "reference"):
            groups.append(
                WorkerGroup(
                    ProbeWorker,
                    2,
                    placement_group=pg,
                    num_cpus_per_worker=share,
                    num_gpus_per_worker=share,
                    name=name,
                    timeout_s=60,
                )
            )
        policy, reference = ([e["CUDA_VISIBLE_DEVICES"] for e in g.run("env")] for g in groups)
        assert policy == reference and sorted(policy) == ["0", "1"]
    finally:
        for g in groups:
            g.shutdown()
        ray.util.remove_placement_group(pg)
