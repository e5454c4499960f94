"""Which transport each engine gets and from which actor rank, the guard against two NCCL ranks on one GPU (fake
GPUs), the CUDA IPC handle's plumbing (CUDA mocked), and the shared-memory hand-over with real engines: exact,
mixed with a gloo broadcast in one sync, reusing its buffers and leaving none behind after a failure."""

from __future__ import annotations

import glob
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from openppo.errors import UserError
from openppo.rollout import transport
from openppo.rollout.sender import (
    TrainerInit,
    TrainerTransfer,
    connect_engines,
    iter_full_weights,
    sync_weights,
    tensors_checksum,
)
from openppo.rollout.transport import (
    BROADCAST,
    CUDA_IPC,
    OBJECT_STORE,
    SHARED_MEMORY,
    SharedSlots,
    SyncPlan,
    Where,
    check_broadcast_group,
    choose_transports,
    describe,
    open_local,
    read_shared,
    shared_slots,
)
from tests import ray_cluster
from tests.engines import cuda_reduce_args, logprob_gap
from tests.model_cache import tiny_model_dir

TOL = 1e-4
PROMPT = [300 + (53 * i) % 9000 for i in range(30)]
REPO = Path(__file__).resolve().parents[2]


def _shm_files() -> set[str]:
    """Named shared-memory files of any weight sync (the hand-over makes none)."""
    return set(glob.glob("/dev/shm/openppo-sync-*"))


def test_transport_per_engine_from_the_placement():
    ranks = [Where("10.0.0.1", (str(g),)) for g in range(4)]
    # the hybrid engine on one node: worker w of engine i on actor rank i*tp + w's GPU, each fed by that rank
    plan = choose_transports(ranks, [[r] for r in ranks], colocated=True, on_gpu=True)
    assert plan == SyncPlan((CUDA_IPC,) * 4, ((0,), (1,), (2,), (3,)))
    assert plan.exchange_ranks == (0, 1, 2, 3) and plan.local_kind == CUDA_IPC
    tp2 = choose_transports(ranks, [ranks[:2], ranks[2:]], colocated=True, on_gpu=True)
    assert tp2.sources == ((0, 1), (2, 3))
    # mixed: an engine on another node, one on a GPU no actor rank has; rank 0 then hands over alone
    mixed = choose_transports(
        ranks[:1], [[ranks[0]], [Where("10.0.0.2", ("0",))], [ranks[3]]], colocated=True, on_gpu=True
    )
    assert mixed == SyncPlan((CUDA_IPC, BROADCAST, BROADCAST), ((0,), (), ()))
    assert mixed.exporters == (0,) and mixed.exchange_ranks == ()
    # a worker on another rank's GPU than its own index: fed by the rank that shares it
    assert choose_transports(ranks, [[ranks[2]]], colocated=True, on_gpu=True).sources == ((2,),)
    # CPU: every process of a node shares its memory; the hybrid engine's workers are fed by their bundle's rank
    cpu = [Where("10.0.0.1"), Where("10.0.0.1")]
    engines = [[Where("10.0.0.1")], [Where("10.0.0.1")], [Where("10.0.0.2")]]
    plan = choose_transports(cpu, engines, colocated=True, on_gpu=False)
    assert plan == SyncPlan((SHARED_MEMORY, SHARED_MEMORY, BROADCAST), ((0,), (1,), ()))
    assert choose_transports(cpu, engines, colocated=False, on_gpu=False).transports == (BROADCAST,) * 3
    # --vllm_sync_with_ray: what is not handed over goes through Ray's object store, in no group
    ray_plan = choose_transports(cpu, engines, colocated=True, on_gpu=False, remote=OBJECT_STORE)
    assert ray_plan.transports == (SHARED_MEMORY, SHARED_MEMORY, OBJECT_STORE)
    assert describe(ray_plan, "gloo").endswith("engine(s) 2 via Ray's object store")
    assert describe(plan, "gloo") == (
        "weight sync: engine(s) 0,1 via shared memory from actor rank(s) 0,1; engine(s) 2 via gloo broadcast"
    )
    assert SyncPlan.of([SHARED_MEMORY, BROADCAST]) == SyncPlan((SHARED_MEMORY, BROADCAST), ((0,), ()))


def test_nccl_group_with_two_members_on_one_gpu_is_refused():
    ok = [
        ("actor rank 0", Where("n", ("0",))),
        ("vLLM engine 1", Where("n", ("1",))),
        ("vLLM engine 2", Where("m", ("0",))),
    ]
    check_broadcast_group(ok, "nccl")
    clash = ok + [("vLLM engine 0", Where("n", ("0",)))]
    with pytest.raises(
        UserError, match="actor rank 0 and vLLM engine 0 on GPU 0.*--vllm_sync_backend nccl.*--colocate_all_models"
    ):
        check_broadcast_group(clash, "nccl")
    check_broadcast_group(clash, "gloo")  # gloo does not care


def test_guard_reads_fake_gpu_placement():
    """Ray hands out fake GPU ids on CPU: two actors sharing one GPU bundle (the hybrid layout) report the same id,
    and the guard refuses them in one nccl group; on separate GPUs it passes."""
    import ray

    from openppo.distributed.logs import actor_location
    from openppo.distributed.placement import colocated_fraction, make_placement_group

    @ray.remote
    class Probe:
        def where(self):
            return actor_location()

    ray.init(address="local", num_cpus=4, num_gpus=2, include_dashboard=False, logging_level="warning")
    try:
        pg = make_placement_group(2, cpus_per_bundle=1, gpus_per_bundle=1, timeout_s=30, name="hybrid")
        share = colocated_fraction(2)
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        def probe(bundle):
            return Probe.options(
                num_cpus=share,
                num_gpus=share,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle),
            ).remote()

        rank0, engine0, engine1 = probe(0), probe(0), probe(1)
        wheres = [Where.of(info) for info in ray.get([a.where.remote() for a in (rank0, engine0, engine1)])]
        assert wheres[0].gpus and wheres[0] == wheres[1] and wheres[1].gpus != wheres[2].gpus
        with pytest.raises(UserError, match="--vllm_sync_backend nccl"):
            check_broadcast_group([("actor rank 0", wheres[0]), ("vLLM engine 0", wheres[1])], "nccl")
        check_broadcast_group([("actor rank 0", wheres[0]), ("vLLM engine 1", wheres[2])], "nccl")
        # engine 0 shares rank 0's GPU: handed over; engine 1's GPU has no actor rank: broadcast
        plan = choose_transports(wheres[:1], [[wheres[1]], [wheres[2]]], colocated=True, on_gpu=True)
        assert plan == SyncPlan((CUDA_IPC, BROADCAST), ((0,), ()))
    finally:
        ray.shutdown()


def test_shared_memory_slots_are_reused_and_released():
    slots = SharedSlots()
    try:
        first, name = slots.write(0, torch.arange(100, dtype=torch.uint8))
        assert torch.equal(read_shared(first, 100, name), torch.arange(100, dtype=torch.uint8))
        assert slots.write(0, torch.full((50,), 7, dtype=torch.uint8)) == (first, name)  # rewritten in place
        assert torch.equal(read_shared(first, 50, name), torch.full((50,), 7, dtype=torch.uint8))
        bigger, new_name = slots.write(0, torch.ones(200, dtype=torch.uint8))  # too small: a new file
        assert new_name != name and slots.paths() == [bigger]
        assert torch.equal(read_shared(bigger, 200, new_name), torch.ones(200, dtype=torch.uint8))
        # another process opens the slot by its path, as an engine worker does
        code = f"import torch; print(torch.from_file({bigger!r}, shared=True, size=200, dtype=torch.uint8).sum())"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and "200" in out.stdout, out.stderr
    finally:
        slots.release()
    assert slots.paths() == []


def test_shared_memory_outlives_no_killed_process():
    """A slot is an anonymous memfd, not a /dev/shm file: a sender killed without clean-up (Ray kills its actors)
    leaves nothing behind."""
    code = (
        "import os, signal, torch; from openppo.rollout.transport import shared_slots; "
        "path, name = shared_slots().write(0, torch.ones(4096, dtype=torch.uint8)); "
        "print(os.readlink(path), flush=True); os.kill(os.getpid(), signal.SIGKILL)"
    )
    before = _shm_files()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == -9 and out.stdout.startswith("/memfd:openppo-sync-"), out.stderr
    assert _shm_files() == before


def test_cuda_ipc_handle_opens_on_this_processes_index_of_the_gpu(monkeypatch):
    """The CUDA-only steps of `open_local`, with CUDA mocked (this box has none): the receiver checks the bucket
    comes from its own GPU (by UUID) and rebuilds it on its own index of that GPU, not the sender's."""
    rebuilt = []

    def fake_rebuild(*args):  # stands in for torch's rebuild_cuda_tensor: records the device index it got
        rebuilt.append(args[6])
        return torch.arange(8, dtype=torch.uint8)

    monkeypatch.setattr("torch.multiprocessing.reductions.rebuild_cuda_tensor", fake_rebuild)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)  # the GPU is cuda:0 in the worker's process...
    monkeypatch.setattr(transport, "gpu_uuid", lambda index: "GPU-aaaa")
    args = cuda_reduce_args(device=3)  # ...and cuda:3 in the sender's (index 6: reduce_tensor's device)
    handle = [CUDA_IPC, "GPU-aaaa", transport.plain_ipc_args(args)]
    assert torch.equal(open_local(handle, 8), torch.arange(8, dtype=torch.uint8))
    assert rebuilt == [0]
    with pytest.raises(RuntimeError, match="from GPU GPU-bbbb reached an engine worker on GPU GPU-aaaa"):
        open_local([CUDA_IPC, "GPU-bbbb", handle[2]], 8)


def test_a_processs_gpu_is_named_as_ray_names_it():
    """The entry of CUDA_VISIBLE_DEVICES a CUDA device index stands for (Ray lists a process's GPUs there by the
    node's ids); without the variable the index is the node's own."""
    assert transport.visible_gpu_id(1, "3,5") == "5"
    assert transport.visible_gpu_id(0, " 7 ") == "7"
    assert transport.visible_gpu_id(0, "GPU-aa,GPU-bb") == "GPU-aa"
    assert transport.visible_gpu_id(2, "") == "2"


@pytest.mark.slow
def test_shared_memory_and_broadcast_engines_in_one_sync_are_exact():
    """Full syncs, then delta syncs (--vllm_sync_delta) through the same two transports: exact after each, a
    delta sync sends only the changed elements, and one that failed half-way is followed by a full one."""
    import ray
    from transformers import AutoModelForCausalLM

    from openppo.rollout import VLLMEngine

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir(), dtype=torch.float32).eval()
    ray_cluster.connect()
    try:
        engines = [
            ray.remote(num_cpus=1)(VLLMEngine).remote(
                str(tiny_model_dir()), dtype="float32", seed=i, max_model_len=256, kv_cache_bytes=32 << 20
            )
            for i in range(2)
        ]
        ray.get([e.ready.remote() for e in engines], timeout=300)
        group = connect_engines(engines[1:], backend="gloo", master_addr="127.0.0.1", timeout_s=120)
        plan = [SHARED_MEMORY, BROADCAST]
        before = _shm_files()
        try:
            g = torch.Generator().manual_seed(3)
            for sync in range(3):
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(torch.randn(p.shape, generator=g) * 0.02)
                stats = sync_weights(
                    model, group, engines, bucket_bytes=64 << 10, timeout_s=120, plan=plan, verify=sync == 0
                )
                assert stats["num_buckets"] > 3  # more buckets than the three buffers kept valid
                assert len(shared_slots().paths()) == 3 and _shm_files() == before  # reused, and nothing named
                for engine in engines:
                    [[sample]] = ray.get(
                        engine.generate.remote([PROMPT], n=1, max_new_tokens=8, temperature=1.0, top_p=1.0), timeout=120
                    )
                    gap = logprob_gap(model, PROMPT, sample)
                    assert gap < TOL, f"sync {sync + 1}: engine log-probs {gap:.3g} off the trainer's"
                if sync == 0:  # verified: every engine received exactly what was sent
                    sums = ray.get([e.last_sync_checksum.remote() for e in engines])
                    assert sums[0] == pytest.approx(sums[1], rel=1e-12)
                else:  # unverified syncs do not sum
                    assert ray.get(engines[0].last_sync_checksum.remote()) is None

            def failing():  # the trainer dies half-way through a sync
                for i, item in enumerate(iter_full_weights(model, rank=0)):
                    if i == 20:
                        raise RuntimeError("trainer failed mid-sync")
                    yield item

            with pytest.raises(RuntimeError, match="mid-sync"):
                sync_weights(failing(), None, engines[:1], bucket_bytes=64 << 10, plan=[SHARED_MEMORY])
            assert shared_slots().paths() == [], "a failed sync kept its shared memory"

            init = TrainerInit(0, SyncPlan.of(plan), bucket_bytes=64 << 10, timeout_s=120, delta=True)
            delta = TrainerTransfer(init, engines, model, group, None)
            embed = model.get_input_embeddings().weight
            for sync, change in enumerate(("all", "rows", "none", "all")):
                with torch.no_grad():
                    if change == "all":
                        for p in model.parameters():
                            p.add_(torch.randn(p.shape, generator=g) * 0.02)
                    elif change == "rows":  # as an update touches only the embedding rows of the tokens it saw
                        embed[PROMPT[:5]] += 0.05
                stats = delta.send_weights(verify=True)
                changed = {"all": 1.0, "rows": 5 * embed.shape[1] / stats["num_elements"], "none": 0.0}[change]
                assert stats["changed"] == pytest.approx(changed, abs=1e-3), f"delta sync {sync + 1}"
                if change != "all":  # 8 bytes per changed fp32 element (index and value), and alignment
                    assert stats["num_bytes"] < 8 * changed * stats["full_bytes"] / 4 + 16 * 2 * stats["num_tensors"]
                expected = tensors_checksum(iter_full_weights(model, rank=0))
                assert (
                    ray.get([e.last_sync_checksum.remote() for e in engines])
                    == [pytest.approx(expected, rel=1e-12)] * 2
                )
                for engine in engines:
                    [[sample]] = ray.get(
                        engine.generate.remote([PROMPT], n=1, max_new_tokens=8, temperature=1.0, top_p=1.0), timeout=120
                    )
                    gap = logprob_gap(model, PROMPT, sample)
                    assert gap < TOL, f"delta sync {sync + 1}: engine log-probs {gap:.3g} off the trainer's"

            # A delta sync that fails half-way leaves the engines with some of its tensors and the sender with all
            # of the ones it encoded: the next sync must go in full, or those would never reach the engines.
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(torch.randn(p.shape, generator=g) * 0.02)
            delta.source = failing()
            with pytest.raises(RuntimeError, match="mid-sync"):
                delta.send_weights()
            delta.source = model
            stats = delta.send_weights(verify=True)
            assert stats["changed"] == 1.0
            expected = tensors_checksum(iter_full_weights(model, rank=0))
            assert ray.get([e.last_sync_checksum.remote() for e in engines]) == [pytest.approx(expected, rel=1e-12)] * 2
        finally:
            group.destroy()
    finally:
        ray.shutdown()
