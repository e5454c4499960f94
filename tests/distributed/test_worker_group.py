"""WorkerGroup and placement groups on a real local Ray cluster (CPU only): env, dispatch, and every way to fail."""

from __future__ import annotations

import socket
import time

import pytest
import ray

from openppo.distributed.logs import format_log_tail, read_log_tail, tail_file
from openppo.distributed.placement import (
    STRATEGIES,
    PlacementError,
    colocated_fraction,
    describe_nodes,
    device_resources,
    make_placement_group,
    strategy_fits,
)
from openppo.distributed.rendezvous import STORE_ENV
from openppo.distributed.worker_group import WorkerGroup, WorkerGroupError
from tests.distributed.workers import BrokenWorker, ProbeWorker


@pytest.fixture(scope="module")
def ray_cpu():
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="warning")
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def probes(ray_cpu):
    group = WorkerGroup(ProbeWorker, 2, name="probe", timeout_s=60, env={"OPENPPO_TEST_FLAG": "on"})
    yield group
    group.shutdown()


# ----------------------------------------------------------------------------------------------- happy paths
def test_device_resources_on_cpu(ray_cpu):
    assert device_resources() == (False, 4)


def test_torch_distributed_env(probes):
    envs = probes.run("env", ("OPENPPO_TEST_FLAG", STORE_ENV))
    assert [e["RANK"] for e in envs] == ["0", "1"]
    for e in envs:
        assert e["WORLD_SIZE"] == "2" and e["LOCAL_RANK"] == "0" and e["LOCAL_WORLD_SIZE"] == "2"
        assert e["OMP_NUM_THREADS"] == "1"  # from num_cpus_per_worker=1
        assert e["OPENPPO_TEST_FLAG"] == "on"
        assert e["MASTER_ADDR"] == probes.worker_infos[0]["node_ip"] == probes.master_addr
        assert e["MASTER_PORT"] == str(probes.master_port) and e[STORE_ENV] == "1"
    # rank 0 serves the rendezvous store on that port from before the ranks were told it: nothing else can take it
    with socket.socket() as probe, pytest.raises(OSError, match="in use"):
        probe.bind((probes.master_addr, probes.master_port))
    assert probes.run("placement_group_id") == [probes.placement_group.id.hex()] * 2  # its own PACK group


def test_run_sharded_gives_rank_i_shard_i(probes):
    shards = [{"rows": [1, 2]}, {"rows": [3]}]
    assert probes.run_sharded("echo", shards, tag="t") == [(0, shards[0], "t"), (1, shards[1], "t")]
    with pytest.raises(ValueError, match="3 shards for 2 ranks"):
        probes.run_sharded("echo", [1, 2, 3])


def test_methods_by_reference(probes):
    """The typed form the RL driver uses: the worker class's method itself (an editor follows it to the code)."""
    shards = [{"rows": [1, 2]}, {"rows": [3]}]
    assert probes.run_sharded(ProbeWorker.echo, shards, tag="t") == [(0, shards[0], "t"), (1, shards[1], "t")]
    assert probes.run(ProbeWorker.echo, "x") == [(0, "x", ""), (1, "x", "")]
    with pytest.raises(AttributeError, match="is not a method of ProbeWorker"):
        probes.run(BrokenWorker.__init__)  # a method of another worker class


def test_run_async_then_get(probes):
    refs = probes.run_async("echo", "x")
    assert len(refs) == 2
    assert probes.get(refs) == [(0, "x", ""), (1, "x", "")]


def test_unknown_method_is_rejected_before_any_call(probes):
    with pytest.raises(AttributeError, match="ProbeWorker has no method 'trian'"):
        probes.run("trian")


def test_colocated_groups_share_bundles_on_cpu(ray_cpu):
    """Two groups take half a CPU of the same two bundles; a third that wants more than is left fails in time.

    (Which bundle a rank got is not visible on CPU; test_fake_gpus checks it through CUDA_VISIBLE_DEVICES.)
    """
    pg = make_placement_group(2, cpus_per_bundle=1, timeout_s=30, name="colocated")
    share = colocated_fraction(2)
    groups = []
    try:
        for name in ("policy", "reference"):
            groups.append(
                WorkerGroup(ProbeWorker, 2, placement_group=pg, num_cpus_per_worker=share, name=name, timeout_s=60)
            )
        assert [g.run("placement_group_id") for g in groups] == [[pg.id.hex()] * 2] * 2
        # Each group is its own torch.distributed world.
        assert groups[0].master_port != groups[1].master_port
        t0 = time.monotonic()
        with pytest.raises(WorkerGroupError, match=r"(?s)'critic' rank 0 .*did not finish 'ping' during start-up"):
            WorkerGroup(ProbeWorker, 2, placement_group=pg, num_cpus_per_worker=share, name="critic", timeout_s=3)
        assert time.monotonic() - t0 < 20
    finally:
        for g in groups:
            g.shutdown()
        ray.util.remove_placement_group(pg)


def test_placement_group_larger_than_cluster_fails_in_time(probes):
    t0 = time.monotonic()
    with pytest.raises(PlacementError) as err:
        make_placement_group(3, cpus_per_bundle=2, timeout_s=2, name="too-big")
    elapsed = time.monotonic() - t0
    message = str(err.value)
    assert "3 x {CPU=2}" in message and "CPU=6 in all" in message and "the cluster has CPU=4 in all" in message
    assert elapsed < 10, elapsed
    # Nothing stays reserved: the same cluster (2 of its 4 CPUs held by `probes`) still places what fits.
    ray.util.remove_placement_group(make_placement_group(1, cpus_per_bundle=2, timeout_s=30))
    with pytest.raises(PlacementError, match="could not be placed"):
        WorkerGroup(ProbeWorker, 5, name="too-many", timeout_s=2)


# ----------------------------------------------------------------------------------------------- failures
def test_method_that_raises_names_group_rank_and_text(ray_cpu):
    group = WorkerGroup(ProbeWorker, 2, name="raiser", timeout_s=60)
    with pytest.raises(WorkerGroupError) as err:
        group.run("raise_on", 1, "bad batch 7")
    e = err.value
    assert e.group == "raiser" and e.rank == 1
    assert "worker group 'raiser' rank 1" in str(e) and "ValueError: bad batch 7" in str(e)
    assert e.actor in str(e) and group.worker_infos[1]["actor_id"] in e.actor
    assert "rank 1 about to check its batch" in e.log_tail  # what the rank logged just before
    with pytest.raises(RuntimeError, match="shut down"):
        group.run("echo", 1)


def test_constructor_failure_is_reported_at_start_up(ray_cpu):
    with pytest.raises(WorkerGroupError, match=r"(?s)'broken' rank 1 .*died in 'ping' during start-up.*no weights"):
        WorkerGroup(BrokenWorker, 2, name="broken", timeout_s=60, init_args=("no weights here",))


def test_process_exit_is_detected_at_once(ray_cpu):
    """Rank 1 exits while rank 0 waits (as in a collective): the call fails at once, not after the timeout."""
    group = WorkerGroup(ProbeWorker, 2, name="exiter", timeout_s=60)
    t0 = time.monotonic()
    with pytest.raises(WorkerGroupError) as err:
        group.run("exit_on", 1, 120)
    elapsed = time.monotonic() - t0
    print(f"os._exit detected after {elapsed:.2f} s")
    assert elapsed < 10, elapsed
    e = err.value
    assert e.rank == 1 and "worker group 'exiter' rank 1" in str(e) and "died in 'exit_on'" in str(e)
    assert "rank 1 exiting the process now" in e.log_tail  # read from its Ray log file after it died
    # The waiting rank 0 was killed with the group rather than left sleeping.
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(group.actors[0].ping.remote(), timeout=30)


def test_a_dead_rank_is_named_before_one_that_raised(ray_cpu):
    group = WorkerGroup(ProbeWorker, 2, name="peers", timeout_s=60)
    with pytest.raises(WorkerGroupError) as err:
        group.run("raise_then_exit")
    assert err.value.rank == 1 and "rank 1" in str(err.value) and "died in 'raise_then_exit'" in str(err.value)
    assert "(rank 0 failed too, probably as a consequence: RuntimeError: Connection reset by peer)" in str(err.value)


def test_killed_actor_is_detected(ray_cpu):
    group = WorkerGroup(ProbeWorker, 2, name="victim", timeout_s=60)
    refs = group.run_async("sleep", 120)
    time.sleep(0.5)
    t0 = time.monotonic()
    ray.kill(group.actors[0])
    with pytest.raises(WorkerGroupError, match=r"(?s)'victim' rank 0 \(ProbeWorker actor .*\) died in 'sleep'"):
        group.get(refs)
    print(f"ray.kill detected after {time.monotonic() - t0:.2f} s")
    assert time.monotonic() - t0 < 10


def test_hang_times_out_with_log_tail(ray_cpu):
    group = WorkerGroup(ProbeWorker, 2, name="sleeper", timeout_s=60)
    t0 = time.monotonic()
    with pytest.raises(WorkerGroupError) as err:
        group.get(group.run_async("sleep", 120), timeout_s=3)
    elapsed = time.monotonic() - t0
    print(f"hang reported after {elapsed:.2f} s (timeout 3 s)")
    assert 3 <= elapsed < 15, elapsed
    e = err.value
    assert "did not finish 'sleep' within 3 s (ranks still running: 0, 1)" in str(e)
    assert "rank 0 going to sleep for 120 s" in e.log_tail


# ----------------------------------------------------------------------------------------------- pieces
def test_argument_errors():
    with pytest.raises(TypeError, match="plain subclass of BaseWorker"):
        WorkerGroup(object, 2)
    with pytest.raises(ValueError, match="num_workers must be >= 1"):
        WorkerGroup(ProbeWorker, 0)
    with pytest.raises(ValueError, match="num_colocated"):
        colocated_fraction(0)
    assert colocated_fraction(3) * 3 <= 1.0 and colocated_fraction(5) == 0.2
    with pytest.raises(ValueError, match="both 0"):
        make_placement_group(1, cpus_per_bundle=0, gpus_per_bundle=0)


def test_which_strategy_can_place_a_group_and_where_the_ranks_are():
    nodes = [8, 8, 0]  # devices per node: two nodes of 8 and one (a head) of none
    assert [strategy_fits(s, 2, nodes) for s in STRATEGIES] == [True] * 4
    assert [strategy_fits(s, 3, nodes) for s in STRATEGIES] == [True, True, True, False]  # 3 nodes, 2 with devices
    assert [strategy_fits(s, 9, nodes) for s in STRATEGIES] == [True, True, False, False]  # no node has 9
    assert [strategy_fits(s, 17, nodes) for s in STRATEGIES] == [False] * 4
    where = {"actor": ["10.0.0.1", "10.0.0.2", "10.0.0.1"], "engines": ["10.0.0.2"]}
    assert describe_nodes(where) == "actor 10.0.0.1 [0 2], 10.0.0.2 [1]; engines 10.0.0.2 [0]"


def test_log_tail_drops_ray_markers(tmp_path):
    out = tmp_path / "worker-x.out"
    err = tmp_path / "worker-x.err"
    out.write_text(":job_id:01000000\n:actor_name:ProbeWorker\n" + "".join(f"line {i}\n" for i in range(30)))
    err.write_text("Traceback (most recent call last):\nValueError: x\n")
    assert tail_file(str(out), 3) == ["line 27", "line 28", "line 29"]
    tails = read_log_tail([str(err), str(out), str(tmp_path / "missing.out")], None, 2, 5)
    text = format_log_tail(tails)
    assert text.index("stdout") < text.index("stderr") and text.endswith("ValueError: x")
    assert ":job_id:" not in text


def test_log_tail_read_on_the_workers_node(ray_cpu, tmp_path):
    """The remote path: a zero-CPU task pinned to the node reads the files there."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from openppo.distributed.logs import _tail_files_task

    path = tmp_path / "worker-y.out"
    path.write_text("a\nb\nc\n")
    node_id = ray.get_runtime_context().get_node_id()
    task = _tail_files_task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))
    assert ray.get(task.remote([str(path)], 2), timeout=60) == {str(path): ["b", "c"]}
