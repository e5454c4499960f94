"""The driver's handle on the vLLM engines of a run, and the `Sample` each completion becomes.

`EnginePool.generate` spreads prompts round-robin over the engines, one request per engine and response budget,
and waits at most `timeout_s`. Its `lock` keeps generation and weight replacement apart: an engine never generates
while its weights are being replaced (the actor group's sync holds the lock), which also makes the engines' prefix
cache reset at the end of a sync safe.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Sample:
    """One generated response, as it comes back from an engine (or an agent episode)."""

    prompt_ids: list[int]
    response_ids: list[int]
    rollout_log_probs: list[float]  # sampled-token log-probs from the engine, one per response token
    finish_reason: str  # "stop" or "length"
    group: int  # index of the prompt; the n samples of one prompt share it and must be consecutive
    label: Any = None
    prompt_text: str = ""
    response_text: str = ""
    policy_version: int = 0  # the weight version that generated it (for async staleness)
    action_mask: list[int] | None = None  # per response token; None = all ones (single turn)
    reward: float | None = None
    score: float | None = None
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


class EnginePool:
    """The run's engines (Ray actors of `VLLMEngine`), what each reported at start-up, and the sync lock."""

    def __init__(self, engines: Sequence[Any], infos: Sequence[dict[str, Any]] = (), *, timeout_s: float = 600.0):
        self.engines = list(engines)
        self.infos = list(infos)  # pid, node, log files of each engine (failure reports)
        self.timeout_s = timeout_s
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.engines)

    def generate(
        self,
        prompt_ids: list[list[int]],
        *,
        n: int,
        max_new_tokens: int | list[int],
        temperature: float,
        top_p: float,
        top_k: int,
        seed: int | None = None,
    ) -> list[list[dict]]:
        """`n` completions per prompt (`VLLMEngine.generate`'s dicts), in prompt order. `max_new_tokens` is one budget
        or one per prompt. With a `seed`, each request reseeds its engine's sampling with its own number derived
        from it (--full_determinism)."""
        import ray

        budgets = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompt_ids)
        refs, slots = [], []
        with self.lock:
            for e, engine in enumerate(self.engines):
                chunk = list(range(e, len(prompt_ids), len(self.engines)))
                if not chunk:
                    continue
                refs.append(
                    engine.generate.remote(
                        [prompt_ids[i] for i in chunk],
                        n=n,
                        max_new_tokens=[budgets[i] for i in chunk],
                        temperature=temperature,
                        top_p=top_p,
                        top_k=top_k,
                        seed=None if seed is None else seed + 1_000 * e,
                    )
                )
                slots.append(chunk)
            results = ray.get(refs, timeout=self.timeout_s)
        outputs: list[list[dict]] = [[] for _ in prompt_ids]
        for chunk, out in zip(slots, results):
            for i, completions in zip(chunk, out):
                outputs[i] = completions
        return outputs

    def sleep(self) -> None:
        """Engines free weights and KV cache (vLLM sleep; a no-op on CPU)."""
        import ray

        ray.get([e.sleep.remote() for e in self.engines], timeout=self.timeout_s)

    def wake_up(self, tags: list[str]) -> None:
        import ray

        ray.get([e.wake_up.remote(tags) for e in self.engines], timeout=self.timeout_s)
