"""Who holds the device memory when everything is colocated (--vllm_enable_sleep, --deepspeed_enable_sleep)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

from openppo.ppo.config import PPOConfig
from openppo.ppo.groups import Groups


class MemorySwap:
    """Who holds the device memory when everything is colocated.

    Engines sleep (`--vllm_enable_sleep`) while the trainer runs and wake for the weight sync (weights first, so the
    KV cache is only re-allocated once the trainer has offloaded its states); the trainer's optimizer, gradient and
    parameter states are offloaded (`--deepspeed_enable_sleep`) while the engines generate. Each switch is timed.
    """

    def __init__(self, cfg: PPOConfig, groups: Groups, timer: Callable[[str], AbstractContextManager]):
        self.engines_sleep = cfg.vllm.vllm_enable_sleep
        self.trainer_sleep = cfg.ds.deepspeed_enable_sleep
        self.groups = groups
        self.timer = timer  # `with timer("swap"):` adds to the step's timing/swap

    def to_trainer(self) -> None:
        """After generation: engines release their memory, the trainer takes its states back."""
        if self.engines_sleep:
            with self.timer("swap"):
                self.groups.engines.sleep()
        if self.trainer_sleep:
            with self.timer("swap"):
                for g in self.groups.trained():
                    g.reload_states()

    def engine_weights(self) -> None:
        """Before the weight sync: engine weights back in memory (the trainer still holds its own)."""
        if self.engines_sleep:
            with self.timer("swap"):
                self.groups.engines.wake_up(["weights"])

    def start(self) -> None:
        """Before the first generation: the engines are awake; the trainer's states go out of their way."""
        if self.trainer_sleep:
            for g in self.groups.trained():
                g.offload_states()

    def to_engines(self) -> None:
        """After the sync: the trainer offloads, then the engines re-allocate their KV cache."""
        if self.trainer_sleep:
            with self.timer("swap"):
                for g in self.groups.trained():
                    g.offload_states()
        if self.engines_sleep:
            with self.timer("swap"):
                self.groups.engines.wake_up(["kv_cache"])
