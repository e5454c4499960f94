"""A real vLLM engine on the tiny test model, in a Ray actor of a private local cluster (for module fixtures)."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

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


@contextlib.contextmanager
def tiny_engine_actor(kv_cache_bytes: int = 64 << 20) -> Iterator[Any]:
    import ray

    from openppo.rollout import VLLMEngine

    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="warning")
    try:
        t0 = time.monotonic()
        actor = ray.remote(num_cpus=1)(VLLMEngine).remote(
            str(tiny_model_dir()),
            dtype="float32",
            seed=0,
            max_model_len=256,
            kv_cache_bytes=kv_cache_bytes,
            enable_prefix_caching=True,
        )
        ray.get(actor.ready.remote(), timeout=180)
        print(f"engine actor ready in {time.monotonic() - t0:.1f} s")
        yield actor
        ray.kill(actor)
    finally:
        ray.shutdown()
