"""A real vLLM engine on the tiny test model, in a Ray actor of the session cluster (for module fixtures)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from openppo.utils import shm
from tests import ray_cluster
from tests.engine_zygote import SPAWNED
from tests.model_cache import tiny_model_dir


def logprob_gap(model, prompt: list[int], sample: dict, temperature: float = 1.0) -> float:
    """Largest |engine log-prob - HF log-prob| over a sample's tokens: the HF `model` scores `prompt + response` in
    fp32 at `temperature`; `sample` is one of `VLLMEngine.generate`'s results."""
    import torch

    response = sample["token_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response]), use_cache=False).logits[0, len(prompt) - 1 : -1].float()
    expected = torch.log_softmax(logits / temperature, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]
    return (expected - torch.tensor(sample["logprobs"])).abs().max().item()


def vllm_shm_files() -> set[str]:
    """vLLM's files in /dev/shm: its message queues' buffers (`psm_*`, Python's SharedMemory) and the CPU
    communicator's (`vllm_dist_*`); a tensor-parallel engine makes them, and removes them when shut down."""
    import glob

    return set(glob.glob("/dev/shm/psm_*") + glob.glob("/dev/shm/vllm_dist_*"))


def vllm_shm_left_behind(before: set[str]) -> set[str]:
    """vLLM's /dev/shm files made since `before` that no live process maps or holds open: what a shut-down engine
    left. A file a live engine uses (another run's, where test workers run side by side) is not counted."""
    return shm.orphans(vllm_shm_files() - before)


def shm_files_of(pid: int) -> set[str]:
    """The /dev/shm files that process `pid` and its descendants map or hold open: a vLLM engine's message-queue
    buffers (`psm_*`, Python's SharedMemory) and its CPU communicator's (`vllm_dist_*`). Asked per process tree, not
    by listing /dev/shm, so another run on the box (a parallel test worker) cannot show up in it."""
    return shm.held_by(pid).union(*shm.held_by_descendants(pid).values())


def start_tiny_engine(kv_cache_bytes: int = 64 << 20, spawned: bool = True, **kwargs) -> Any:
    """A `VLLMEngine` actor of the tiny fp32 model in the running Ray session, once it is ready. `spawned`: its engine
    core is spawned, as users' are, not forked from the session's zygote (tests/engine_zygote)."""
    import ray

    from openppo.rollout import VLLMEngine

    t0 = time.monotonic()
    actor = ray.remote(num_cpus=1, **(SPAWNED if spawned else {}))(VLLMEngine).remote(
        str(tiny_model_dir()),
        dtype="float32",
        seed=0,
        max_model_len=256,
        kv_cache_bytes=kv_cache_bytes,
        enable_prefix_caching=True,
        **kwargs,
    )
    ray.get(actor.ready.remote(), timeout=180)
    print(f"engine actor ready in {time.monotonic() - t0:.1f} s")
    return actor


@contextlib.contextmanager
def tiny_engine_actor(kv_cache_bytes: int = 64 << 20) -> Iterator[Any]:
    import ray

    ray_cluster.connect()
    try:
        actor = start_tiny_engine(kv_cache_bytes)
        yield actor
        ray.kill(actor)
    finally:
        ray.shutdown()


def cuda_reduce_args(device: int = 0, dtype=None) -> tuple:
    """What torch's `reduce_tensor` returns for a CUDA uint8 buffer of 64 bytes on GPU `device` (this box has no CUDA:
    the handles are stand-in bytes of their real sizes; the types are the real ones: the tensor and storage classes, a
    torch.Size, a torch dtype, ints, bytes and bools)."""
    import torch

    return (
        torch.Tensor,
        torch.Size([64]),
        (1,),
        0,
        torch.storage.TypedStorage,
        dtype or torch.uint8,
        device,
        b"\x01" * 64,  # cudaIpcMemHandle_t
        2 << 20,
        0,
        False,
        b"/torch_1234_5678_0",  # the ref counter's shared-memory file
        0,
        b"\x02" * 64,  # cudaIpcEventHandle_t
        True,
    )
