"""The cluster, not the driver, decides the devices; seed 004's layouts placed down to each process's GPU.

A real Ray cluster on this CPU box: a head node without GPUs (the driver's, as under `ray job submit`) and two worker
nodes with fake GPUs (48 and 16; Ray hands out ids of GPUs it was told about). This process has no CUDA. The run's
decisions (validation, KV cache, threads, backend) follow the cluster; the placement groups are the run's own
(`launch.shared_placement_groups`, `launch.engine_options`), and each rank, engine and vLLM worker is stood in for by
a task placed exactly as it would be, which reports the GPU ids Ray gives it. Where vLLM, not Ray, picks a worker's
GPU (its Ray executor's rule for tensor-parallel workers: the engine's workers on a node use that node's GPU ids in
ascending order, by worker rank), the rule is applied to the ids the stand-ins got. The sync plan is then made by
`launch.sync_plan` from those reports, as at run time.
"""

from __future__ import annotations

import os
import re

import pytest
import ray
import torch

from openppo.config.schema import parse_config
from openppo.errors import UserError
from openppo.ppo import launch
from openppo.ppo.config import PPOConfig
from openppo.ppo.plan import make_plan
from openppo.ppo.validate import validate_devices
from openppo.rollout.transport import BROADCAST, CUDA_IPC
from tests.model_cache import tiny_model_dir

pytestmark = pytest.mark.slow

# seed 004's GPU layouts, with openppo's flat flags
HYBRID = (
    "--actor_num_gpus_per_node 8 --critic_num_gpus_per_node 8 --ref_num_gpus_per_node 8 --reward_num_gpus_per_node 8 "
    "--vllm_num_engines 4 --vllm_tensor_parallel_size 2 --colocate_all_models --vllm_gpu_memory_utilization 0.5 "
    "--vllm_enable_sleep --deepspeed_enable_sleep --reward_pretrain {model}"
)
SEPARATE_70B = (
    "--actor_num_nodes 2 --actor_num_gpus_per_node 8 --critic_num_nodes 2 --critic_num_gpus_per_node 8 "
    "--vllm_num_engines 4 --vllm_tensor_parallel_size 4 --zero_stage 3 --remote_rm_url r.py --init_kl_coef 0"
)
MIXED = (
    "--actor_num_gpus_per_node 8 --ref_num_gpus_per_node 8 --critic_num_gpus_per_node 8 --reward_num_gpus_per_node 8 "
    "--colocate_actor_ref --colocate_critic_reward --vllm_num_engines 4 --vllm_tensor_parallel_size 2 "
    "--reward_pretrain {model}"
)


def _cfg(flags: str) -> PPOConfig:
    model = str(tiny_model_dir())
    argv = f"--pretrain {model} --prompt_data p.jsonl --param_dtype bf16 --rollout_batch_size 16 --train_batch_size 64"
    return parse_config(PPOConfig, (argv + " " + flags.format(model=model)).split(), "t")


@pytest.mark.parametrize(
    "flags,cores,threads",
    [
        ("--vllm_num_engines 2", 2, 1),  # the two engines generate side by side: one core each
        ("--vllm_num_engines 1", 2, 2),  # one engine, then one actor rank: each has the box
        ("--vllm_num_engines 1 --actor_num_gpus_per_node 2", 4, 2),  # two ranks train side by side
        ("--vllm_num_engines 1 --async_train", 4, 2),  # the engine generates while the rank trains
        ("--vllm_num_engines 2 --async_train", 6, 2),
        ("--vllm_num_engines 1 --actor_num_gpus_per_node 4 --eval_only --eval_dataset e.jsonl", 4, 4),  # no actor
        # a larger scoring group than the actor's: its ranks work side by side too
        ("--vllm_num_engines 1 --init_kl_coef 0.01 --ref_num_gpus_per_node 4", 8, 2),
        ("--vllm_num_engines 1 --reward_pretrain {model} --reward_num_gpus_per_node 2 --async_train", 6, 2),
        (
            "--vllm_num_engines 1 --reward_pretrain {model} --reward_num_gpus_per_node 2 --actor_num_gpus_per_node 4 "
            "--eval_only --eval_dataset e.jsonl",
            4,
            2,
        ),
    ],
)
def test_cpu_threads_split_the_cores_between_the_processes_that_run_at_once(monkeypatch, flags, cores, threads):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    cfg = _cfg(flags)
    eval_only = launch.evaluates_pretrain(cfg)
    assert launch.cpu_threads_per_process(cfg, on_gpu=False, eval_only=eval_only) == threads
    assert launch.cpu_threads_per_process(cfg, on_gpu=True) == 4


@pytest.fixture(scope="module")
def gpu_cluster():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0})
    cluster.add_node(num_cpus=64, num_gpus=48)
    cluster.add_node(num_cpus=16, num_gpus=16)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, logging_level="warning")
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def _report() -> dict:
    return {
        "node_ip": ray.util.get_node_ip_address(),
        "node_id": ray.get_runtime_context().get_node_id(),
        "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
    }


_where = ray.remote(_report)


def _on(pg, bundle: int, num_gpus: float, num_cpus: float = 0.0, capture: bool = False):
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    strategy = PlacementGroupSchedulingStrategy(
        pg, placement_group_bundle_index=bundle, placement_group_capture_child_tasks=capture
    )
    return _where.options(num_cpus=num_cpus, num_gpus=num_gpus, scheduling_strategy=strategy).remote()


def _place(cfg: PPOConfig) -> tuple[dict[str, list[dict]], list[dict], list[list[dict]]]:
    """(role -> each rank's report, each engine actor's report, each engine's workers' reports) of the layout."""
    from ray.util.placement_group import remove_placement_group

    from openppo.distributed.placement import make_placement_group

    plan = make_plan(cfg, num_prompts=64)
    shared = launch.shared_placement_groups(cfg, set(plan.roles), True, 60)
    owned = []
    ranks = {}
    for name, role in plan.roles.items():
        if name in shared:
            pg, share = shared[name]
        else:  # as a WorkerGroup makes its own: one bundle of a whole GPU per rank
            strategy = cfg.resources.placement_strategy
            pg = make_placement_group(role.ranks, cpus_per_bundle=1, gpus_per_bundle=1, strategy=strategy, timeout_s=60)
            share = 1.0
            owned.append(pg)
        # one stand-in at a time: Ray then runs them all in one idle worker process instead of starting one each
        ranks[name] = [ray.get(_on(pg, rank, share, share), timeout=60) for rank in range(role.ranks)]
    tp = cfg.vllm.vllm_tensor_parallel_size
    engines, workers = [], []
    for i in range(cfg.vllm.vllm_num_engines):
        options, place = launch.engine_options(cfg, i, shared, {}, on_gpu=True)
        options.pop("runtime_env")  # environment variables only (the stand-in would need a worker process of its own)
        # An engine of its own takes GPUs from the ones no placement group reserved; its stand-in does not hold them
        # (the engines' count is check_layout_fits's), so the engines' stand-ins may get the same ones in turn.
        engine = ray.get(_where.options(**options).remote(), timeout=60)
        if place.executor == "ray":  # vLLM's Ray executor: a worker per bundle, then ids in ascending order
            share = float(dict(place.env)["VLLM_RAY_PER_WORKER_GPUS"])
            pg = shared["engines"][0]
            got = [ray.get(_on(pg, b, share), timeout=60) for b in place.bundles]
            ids = sorted((g for w in got for g in w["gpu_ids"]), key=int)
            workers.append([{**w, "gpu_ids": [ids[rank]]} for rank, w in enumerate(got)])
        else:  # one actor holds the engine's GPUs; its w-th visible GPU is worker w's (vLLM's mp executor)
            visible = engine["visible"].split(",")
            assert len(visible) == len(engine["gpu_ids"]) == (len(place.bundles) if place.bundles else tp)
            workers.append([{**engine, "gpu_ids": [visible[w]]} for w in range(len(visible))])
        engines.append(engine)
    for pg, _ in {id(v[0]): v for v in shared.values()}.values():
        remove_placement_group(pg)
    for pg in owned:
        remove_placement_group(pg)
    return ranks, engines, workers


def test_a_gpu_cluster_behind_a_gpu_less_driver_runs_as_gpus(gpu_cluster):
    devices = launch.cluster_devices()
    assert not torch.cuda.is_available()  # the driver's own view would have said CPU
    assert devices.on_gpu and devices.count == 64 and not devices.local, devices
    cfg = _cfg(HYBRID)
    notices = validate_devices(cfg, devices.on_gpu)
    assert not any("no GPU" in n or "no-op on CPU" in n for n in notices), notices
    assert launch.kv_cache_bytes(cfg, devices.on_gpu) is None  # vLLM sizes it from --vllm_gpu_memory_utilization
    options, place = launch.engine_options(cfg, 0, {}, {}, on_gpu=devices.on_gpu)
    assert options["num_gpus"] == 2 and place.executor is None  # an engine of its own: TP 2 GPUs
    with pytest.raises(UserError, match="--deepcompile needs a GPU"):
        validate_devices(_cfg("--deepcompile --zero_stage 2 --remote_rm_url r.py"), on_gpu=False)
    validate_devices(_cfg("--deepcompile --zero_stage 2 --remote_rm_url r.py"), on_gpu=devices.on_gpu)


def test_the_hybrid_engine_places_every_worker_on_an_actor_ranks_gpu(gpu_cluster):
    """4 engines x TP 2 on the 8 GPUs of actor, reference, critic and reward model."""
    cfg = _cfg(HYBRID)
    ranks, engines, workers = _place(cfg)
    gpus = {name: [(r["node_id"], r["gpu_ids"][0]) for r in reports] for name, reports in ranks.items()}
    assert len(set(gpus["actor"])) == 8 and all(gpus[name] == gpus["actor"] for name in gpus)  # rank i: one GPU
    for i, (engine, engine_workers) in enumerate(zip(engines, workers)):
        # the engine actor sees its first bundle's GPU only, actor rank 2i's (not the node's whole list)
        assert engine["visible"] == ranks["actor"][2 * i]["gpu_ids"][0], (i, engine)
        for worker in engine_workers:
            assert (worker["node_id"], worker["gpu_ids"][0]) in gpus["actor"][2 * i : 2 * i + 2]
    plan = launch.sync_plan(cfg, ranks["actor"], workers, "nccl", on_gpu=True)
    assert plan.transports == (CUDA_IPC,) * 4
    for i, sources in enumerate(plan.sources):  # each worker is fed by the actor rank on its own GPU
        for w, rank in enumerate(sources):
            assert ranks["actor"][rank]["gpu_ids"] == workers[i][w]["gpu_ids"]


@pytest.mark.parametrize("layout", ["separate_70b", "mixed"])
def test_engines_of_their_own_get_gpus_no_rank_holds(gpu_cluster, layout):
    cfg = _cfg({"separate_70b": SEPARATE_70B, "mixed": MIXED}[layout])
    ranks, engines, workers = _place(cfg)
    trainer = [(r["node_id"], r["gpu_ids"][0]) for reports in ranks.values() for r in reports]
    engine_gpus = [(w["node_id"], w["gpu_ids"][0]) for ws in workers for w in ws]
    tp = cfg.vllm.vllm_tensor_parallel_size
    assert len(engine_gpus) == 4 * tp and not set(engine_gpus) & set(trainer)  # no GPU a trainer rank holds
    for ws in workers:  # an engine's workers: one node, a GPU each
        assert len({w["node_id"] for w in ws}) == 1 and len({w["gpu_ids"][0] for w in ws}) == tp
    if layout == "mixed":  # actor + reference and critic + reward model share each GPU pairwise
        assert [r["gpu_ids"] for r in ranks["actor"]] == [r["gpu_ids"] for r in ranks["reference"]]
        assert [r["gpu_ids"] for r in ranks["critic"]] == [r["gpu_ids"] for r in ranks["reward"]]
    # gloo: the stand-ins of different engines may have had the same GPUs in turn, which an nccl group refuses
    plan = launch.sync_plan(cfg, ranks["actor"], workers, "gloo", on_gpu=True)
    assert plan.transports == (BROADCAST,) * 4


def test_a_layout_the_cluster_cannot_place_is_refused_in_one_line(gpu_cluster):
    devices = launch.cluster_devices()
    # actor 4 x 8, critic 2 x 8, 5 engines of TP 4: 32 + 16 + 20 = 68 GPUs
    big = _cfg(SEPARATE_70B.replace("--actor_num_nodes 2", "--actor_num_nodes 4") + " --vllm_num_engines 5")
    with pytest.raises(UserError) as refused:
        launch.check_layout_fits(big, make_plan(big, 64), devices)
    message = str(refused.value)
    assert "\n" not in message and "needs 68 GPUs and the cluster has 64" in message, message
    assert "--actor_num_nodes x --actor_num_gpus_per_node" in message and "--vllm_tensor_parallel_size" in message
    # --eval_only of --pretrain starts the engines alone (20 GPUs here), not the training layout
    launch.check_layout_fits(big, make_plan(big, 64), devices, eval_only=True)
    wide = _cfg("--remote_rm_url r.py --init_kl_coef 0 --vllm_num_engines 1 --vllm_tensor_parallel_size 56")
    with pytest.raises(UserError, match="--vllm_tensor_parallel_size 56: .* no node .* more than 48 GPUs"):
        launch.check_layout_fits(wide, make_plan(wide, 64), devices)
    launch.check_layout_fits(_cfg(HYBRID), make_plan(_cfg(HYBRID), 64), devices)


def test_strict_spread_puts_each_rank_of_a_group_on_a_node_of_its_own(gpu_cluster):
    """Two nodes have GPUs: a group of 2 ranks (or a pool of 2 devices) is split over both, and one of 8 refused."""
    devices = launch.cluster_devices()
    assert sorted(count for _, count in devices.nodes) == [0, 16, 48]
    two = _cfg(MIXED.replace("_per_node 8", "_per_node 2") + " --placement_strategy STRICT_SPREAD")
    launch.check_layout_fits(two, make_plan(two, 64), devices)
    ranks, engines, _ = _place(two)
    assert set(ranks) == {"actor", "reference", "critic", "reward"}
    for name, reports in ranks.items():
        assert len({r["node_id"] for r in reports}) == 2, name
    assert [r["node_id"] for r in ranks["actor"]] == [r["node_id"] for r in ranks["reference"]]  # colocated
    eight = _cfg(MIXED + " --placement_strategy STRICT_SPREAD")
    with pytest.raises(UserError) as refused:
        launch.check_layout_fits(eight, make_plan(eight, 64), devices)
    message = str(refused.value)
    assert "\n" not in message and "--placement_strategy STRICT_SPREAD: actor + reference" in message, message
    assert "needs 8 GPUs each on a node of its own" in message, message
    named = re.search(r"nodes have (.*) GPUs;", message)
    assert named and sorted(int(node.split()[-1]) for node in named.group(1).split(", ")) == [0, 16, 48], message
