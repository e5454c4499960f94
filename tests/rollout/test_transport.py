"""Which transport each engine gets, the guard against two NCCL ranks on one GPU (fake GPUs), and the shared-memory
hand-over with real engines: exact, mixed with a gloo broadcast in one sync, reusing two files and leaving none
behind after a failure."""

from __future__ import annotations

import glob
import os

import pytest
import torch

from openppo.errors import UserError
from openppo.rollout.sender import broadcast_weights, connect_engines, iter_full_weights, sync_weights
from openppo.rollout.transport import (BROADCAST, CUDA_IPC, SHARED_MEMORY, Where, check_broadcast_group,
                                       choose_transports, describe, read_shared, SharedSlots)
from tests.engines import logprob_gap
from tests.model_cache import tiny_model_dir

TOL = 1e-4
PROMPT = [300 + (53 * i) % 9000 for i in range(30)]


def test_transport_per_engine_from_the_placement():
    rank0 = Where("10.0.0.1", ("0",))
    # seed 004's hybrid engine on one node: engine 0 shares rank 0's GPU, the others are on GPUs of their own
    engines = [Where("10.0.0.1", (str(g),)) for g in range(4)]
    assert choose_transports(rank0, engines, colocated=True, on_gpu=True) == [CUDA_IPC] + [BROADCAST] * 3
    # a TP-2 engine spanning GPUs 0 and 1, and one on another node
    mixed = [Where("10.0.0.1", ("0", "1")), Where("10.0.0.2", ("0", "1"))]
    assert choose_transports(rank0, mixed, colocated=True, on_gpu=True) == [CUDA_IPC, BROADCAST]
    # CPU: the hybrid engine's engines on rank 0's node share its memory; separate engines keep gloo
    cpu = [Where("10.0.0.1"), Where("10.0.0.1"), Where("10.0.0.2")]
    assert choose_transports(Where("10.0.0.1"), cpu, colocated=True, on_gpu=False) == [SHARED_MEMORY] * 2 + [BROADCAST]
    assert choose_transports(Where("10.0.0.1"), cpu, colocated=False, on_gpu=False) == [BROADCAST] * 3
    assert describe([SHARED_MEMORY, SHARED_MEMORY, BROADCAST], "gloo") == (
        "weight sync: engine(s) 0,1 via shared memory; engine(s) 2 via gloo broadcast")


def test_nccl_group_with_two_members_on_one_gpu_is_refused():
    ok = [("actor rank 0", Where("n", ("0",))), ("vLLM engine 1", Where("n", ("1",))),
          ("vLLM engine 2", Where("m", ("0",)))]
    check_broadcast_group(ok, "nccl")
    clash = ok + [("vLLM engine 0", Where("n", ("0",)))]
    with pytest.raises(UserError, match="actor rank 0 and vLLM engine 0 on GPU 0.*--vllm_sync_backend nccl"):
        check_broadcast_group(clash, "nccl")
    check_broadcast_group(clash, "gloo")  # gloo does not care


def test_guard_reads_fake_gpu_placement():
    """Ray hands out fake GPU ids on CPU: two actors sharing one GPU bundle (the hybrid layout) report the same id,
    and the guard refuses them in one nccl group; on separate GPUs it passes."""
    import ray

    from openppo.distributed import colocated_fraction, make_placement_group
    from openppo.distributed.logs import actor_location

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
            return Probe.options(num_cpus=share, num_gpus=share, scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=bundle)).remote()

        rank0, engine0, engine1 = probe(0), probe(0), probe(1)
        wheres = [Where.of(info) for info in ray.get([a.where.remote() for a in (rank0, engine0, engine1)])]
        assert wheres[0].gpus and wheres[0] == wheres[1] and wheres[1].gpus != wheres[2].gpus
        with pytest.raises(UserError, match="--vllm_sync_backend nccl"):
            check_broadcast_group([("actor rank 0", wheres[0]), ("vLLM engine 0", wheres[1])], "nccl")
        check_broadcast_group([("actor rank 0", wheres[0]), ("vLLM engine 1", wheres[2])], "nccl")
        assert choose_transports(wheres[0], wheres[1:], colocated=True, on_gpu=True) == [CUDA_IPC, BROADCAST]
    finally:
        ray.shutdown()


def test_shared_memory_slots_are_reused_and_released():
    slots = SharedSlots()
    try:
        first = slots.write(0, torch.arange(100, dtype=torch.uint8))
        assert torch.equal(read_shared(first, 100), torch.arange(100, dtype=torch.uint8))
        assert slots.write(0, torch.full((50,), 7, dtype=torch.uint8)) == first  # rewritten in place
        assert torch.equal(read_shared(first, 50), torch.full((50,), 7, dtype=torch.uint8))
        bigger = slots.write(0, torch.ones(200, dtype=torch.uint8))  # too small: a new file, the old one gone
        assert bigger != first and not os.path.exists(first) and slots.paths() == [bigger]
        assert torch.equal(read_shared(bigger, 200), torch.ones(200, dtype=torch.uint8))
    finally:
        slots.release()
    assert not os.path.exists(bigger) and slots.paths() == []


def _files() -> set[str]:
    return set(glob.glob(f"/dev/shm/openppo-sync-{os.getpid()}-*"))


@pytest.mark.slow
def test_shared_memory_and_broadcast_engines_in_one_sync_are_exact():
    import ray
    from transformers import AutoModelForCausalLM

    from openppo.rollout import VLLMEngine
    from openppo.rollout.sender import shared_slots

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir(), dtype=torch.float32).eval()
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="warning")
    try:
        engines = [ray.remote(num_cpus=1)(VLLMEngine).remote(str(tiny_model_dir()), dtype="float32", seed=i,
                                                             max_model_len=256, kv_cache_bytes=32 << 20)
                   for i in range(2)]
        ray.get([e.ready.remote() for e in engines], timeout=300)
        group = connect_engines(engines[1:], backend="gloo", master_addr="127.0.0.1", timeout_s=120)
        transports = [SHARED_MEMORY, BROADCAST]
        before = _files()
        try:
            g = torch.Generator().manual_seed(3)
            for sync in range(3):
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(torch.randn(p.shape, generator=g) * 0.02)
                stats = sync_weights(model, group, engines, bucket_bytes=64 << 10, timeout_s=120,
                                     transports=transports, verify=sync == 0)
                assert stats["num_buckets"] > 3  # more buckets than the two kept in flight
                # the sender's two reused slots, nothing else
                assert _files() - before == set(shared_slots().paths()) and len(shared_slots().paths()) == 2
                for engine in engines:
                    [[sample]] = ray.get(engine.generate.remote([PROMPT], n=1, max_new_tokens=8, temperature=1.0,
                                                                top_p=1.0), timeout=120)
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
                broadcast_weights(failing(), None, engines[:1], bucket_bytes=64 << 10, transports=[SHARED_MEMORY])
            assert _files() == before, "a failed sync left shared-memory files behind"
        finally:
            group.destroy()
    finally:
        ray.shutdown()
