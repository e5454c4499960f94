"""The order of memory hand-overs in a colocated step (engines' sleep is a GPU-only vLLM feature, so the engines
and worker groups here are recording stand-ins; the real calls run in tests/ppo/test_train_ppo_features.py, where
vLLM's sleep is a no-op on CPU and DeepSpeed's ZeRO-2 state offload is real)."""

from __future__ import annotations

import contextlib

import pytest

from openppo.config.schema import parse_config
from openppo.ppo.colocation import MemorySwap
from openppo.ppo.config import PPOConfig
from openppo.ppo.groups import Groups
from openppo.rollout.pool import EnginePool


class _Method:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def remote(self, *args):
        import ray

        self.log.append((self.name, *[tuple(a) for a in args]))
        return ray.put(None)


class _Engine:
    def __init__(self, log, tag):
        self.sleep, self.wake_up = _Method(log, f"{tag}.sleep"), _Method(log, f"{tag}.wake_up")


class _Group:
    def __init__(self, log, tag):
        self.log, self.tag = log, tag

    def offload_states(self):
        self.log.append((f"{self.tag}.offload_states",))

    def reload_states(self):
        self.log.append((f"{self.tag}.reload_states",))


@pytest.fixture(scope="module")
def ray_local():
    import ray

    ray.init(address="local", num_cpus=1, include_dashboard=False, logging_level="warning")
    yield
    ray.shutdown()


def _swap(flags, log, timer=None):
    cfg = parse_config(PPOConfig, ["--pretrain", "m", *flags], "t")
    groups = Groups(actor=_Group(log, "actor"), critic=_Group(log, "critic"), engines=EnginePool([_Engine(log, "e0")]))
    return MemorySwap(cfg, groups, timer or (lambda name: contextlib.nullcontext()))


def test_hand_over_order_with_both_sleeps(ray_local):
    log = []
    swap = _swap(["--colocate_all_models", "--vllm_enable_sleep", "--deepspeed_enable_sleep"], log)
    swap.start()
    swap.to_trainer()
    swap.engine_weights()
    swap.to_engines()
    assert log == [
        ("actor.offload_states",),
        ("critic.offload_states",),  # before the first generation
        ("e0.sleep",),
        ("actor.reload_states",),
        ("critic.reload_states",),  # generation done
        ("e0.wake_up", ("weights",)),  # weights back before the sync
        ("actor.offload_states",),
        ("critic.offload_states",),  # trainer out before the KV cache
        ("e0.wake_up", ("kv_cache",)),
    ]


def test_nothing_moves_without_the_flags(ray_local):
    log = []
    swap = _swap([], log)
    swap.start(), swap.to_trainer(), swap.engine_weights(), swap.to_engines()
    assert log == []
