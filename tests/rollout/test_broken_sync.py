"""A weight sync that an engine's death breaks off, with real vLLM CPU engines in Ray (this process is the sender,
rank 0 of their gloo broadcast group): the engine that survives is free at once, not held in a receive until the
group's timeout, and takes the next full sync, over a group formed anew with the dead engine's replacement."""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest
import torch

from openppo.rollout.readback import check_engine_weights
from openppo.rollout.sender import connect_engines, sync_weights
from tests import ray_cluster
from tests.engines import start_tiny_engine
from tests.model_cache import tiny_model_dir

GROUP_TIMEOUT_S = 120  # the broken group's: what a survivor held in a receive would wait
FREE_WITHIN_S = 20  # the survivor answers within this once the sync failed (a fraction of the group's timeout)


def _kill(engine) -> None:
    """SIGKILL an engine's actor and vLLM's engine core under it, as a real cluster's raylet takes a dead worker's
    children with it (tests/engine_kills.py)."""
    import ray

    pid = ray.get(engine.__ray_call__.remote(lambda self: os.getpid()), timeout=60)
    cores = [p for p in psutil.Process(pid).children(recursive=True) if p.name() == "VLLM::EngineCore"]
    for victim in [pid, *(p.pid for p in cores)]:
        os.kill(victim, signal.SIGKILL)


@pytest.mark.slow
def test_the_survivor_of_a_sync_broken_by_a_dead_engine_is_free_and_takes_the_next_one():
    import ray
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir(), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    ray_cluster.connect()
    engines = []
    try:
        survivor, doomed = start_tiny_engine(), start_tiny_engine()
        engines += [survivor, doomed]
        # group ranks: the sender 0, the survivor 1, the doomed engine 2
        group = connect_engines(engines, backend="gloo", master_addr="127.0.0.1", timeout_s=GROUP_TIMEOUT_S)
        _kill(doomed)
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(doomed.ready.remote(), timeout=60)
        began = time.monotonic()
        # the sender's broadcast to the dead member fails (gloo), or the dead member's call (Ray)
        with pytest.raises((RuntimeError, ray.exceptions.RayError)):
            sync_weights(model, group, engines, bucket_bytes=64 << 10, timeout_s=GROUP_TIMEOUT_S)
        ray.get(survivor.ready.remote(), timeout=FREE_WITHIN_S)  # not held in a receive of the broken group
        print(f"the sync failed and the survivor answered {time.monotonic() - began:.1f} s after the sync began")
        # the dead engine's replacement; a new group; the whole sync again
        replacement = start_tiny_engine()
        engines.append(replacement)
        group = connect_engines([survivor, replacement], backend="gloo", master_addr="127.0.0.1", timeout_s=60)
        try:
            sync_weights(model, group, [survivor, replacement], bucket_bytes=64 << 10, timeout_s=60)
        finally:
            group.destroy()
        for engine in (survivor, replacement):
            check = check_engine_weights(model.named_parameters(), ray.get(engine.read_weights.remote(), timeout=60))
            assert check.ok() and max(check.rel_diff.values()) == 0.0, check.summary()
    finally:
        for engine in engines:
            ray.kill(engine)
        ray.shutdown()
