"""Which model groups share devices, and who holds the memory of a shared device when.

The colocation flags become a list of shared pools (pure; no Ray):

A pool is one placement group of `bundles` bundles (one device each: a GPU, or on CPU one worker slot); rank i of
every member group runs in bundle i and asks for `fraction` of it, so the members of a pool share each device.
Groups in no pool get a placement group of their own.

- `--colocate_all_models` (hybrid engine): actor, reference, critic, reward model, teachers and the vLLM engines in
  one pool of the actor's size (validation checks every member has that size). With `--async_train` the engines
  generate while the trainer works, so they stay out of it: the pool ("deepspeed") holds the other models only
  (`engines_colocated`).
- `--colocate_actor_ref`: actor + reference; `--colocate_critic_reward`: critic + reward model.

In the hybrid engine an engine of tensor-parallel size tp takes tp consecutive bundles: worker w of engine i shares
the device of actor rank i * tp + w (`engine_placement`).

`MemorySwap` is the run-time half: with everything colocated, engines sleep while the trainer works
(--vllm_enable_sleep) and the trainer's states leave the device while the engines generate
(--deepspeed_enable_sleep).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

from openppo.distributed.placement import colocated_fraction
from openppo.ppo.config import PPOConfig, engines_colocated

if TYPE_CHECKING:  # the run-time handles import Ray; the placement math does not
    from openppo.ppo.groups import Groups

ROLES = ("actor", "reference", "critic", "reward", "engines")
GPU_SLIVER = 1e-4  # Ray's resource granularity: the least share of a GPU an actor can hold


@dataclass(frozen=True)
class Pool:
    name: str
    bundles: int
    members: tuple[str, ...]

    @property
    def fraction(self) -> float:
        return colocated_fraction(len(self.members))

    def describe(self) -> str:
        return f"{', '.join(self.members)} share {self.bundles} device(s), {self.fraction:g} of each"


def colocation_pools(cfg: PPOConfig, present: set[str]) -> list[Pool]:
    """The pools for the groups in `present` (a subset of ROLES); pools of one member are left out."""
    res = cfg.resources
    teachers = sorted(r for r in present if r.startswith("teacher"))
    unknown = present - set(ROLES) - set(teachers)
    if unknown:
        raise ValueError(f"unknown roles {sorted(unknown)}")
    actor_size = res.actor_num_nodes * res.actor_num_gpus_per_node
    if res.colocate_all_models:
        hybrid = engines_colocated(cfg)
        members = tuple(r for r in ROLES if r in present and (hybrid or r != "engines")) + tuple(teachers)
        return [Pool("hybrid" if hybrid else "deepspeed", actor_size, members)] if len(members) > 1 else []
    pools = []
    if res.colocate_actor_ref and "reference" in present:
        pools.append(Pool("actor_ref", actor_size, ("actor", "reference")))
    if res.colocate_critic_reward and {"critic", "reward"} <= present:
        pools.append(Pool("critic_reward", res.critic_num_nodes * res.critic_num_gpus_per_node, ("critic", "reward")))
    return pools


@dataclass(frozen=True)
class EnginePlacement:
    """Where engine i of the run goes and what its Ray actor asks for (pure data; launch.py makes the Ray options).

    `bundles` is None for an engine on devices of its own. In the hybrid pool, a tensor-parallel engine on GPUs runs
    its workers as Ray actors of vLLM's Ray executor, one per bundle (`env` tells vLLM which bundles and what share
    of each GPU); the engine's own actor then holds a sliver of its first bundle's GPU. On CPU vLLM's workers are
    processes of the engine actor.
    """

    num_cpus: float
    num_gpus: float
    bundles: tuple[int, ...] | None = None
    executor: str | None = None  # vLLM's distributed_executor_backend; None = vLLM's default
    env: tuple[tuple[str, str], ...] = ()


def engine_placement(cfg: PPOConfig, engine_index: int, *, on_gpu: bool, hybrid_share: float | None) -> EnginePlacement:
    """The placement of engine `engine_index`; `hybrid_share` is the engines' share of each hybrid bundle (None when
    the engines are not colocated)."""
    tp = cfg.vllm.vllm_tensor_parallel_size
    gpu = 1.0 if on_gpu else 0.0
    if hybrid_share is None:
        return EnginePlacement(num_cpus=1, num_gpus=gpu * tp)
    bundles = tuple(range(engine_index * tp, (engine_index + 1) * tp))
    if on_gpu and tp > 1:
        # The engine actor (vLLM's client, whose engine core drives the Ray executor) takes a sliver of its first
        # bundle's GPU, and the workers the rest of their share: an actor with no GPU keeps its node's whole
        # CUDA_VISIBLE_DEVICES under Ray 2.60, so its engine core would open its CUDA context on the node's GPU 0,
        # another rank's. With the sliver, Ray shows it that bundle's GPU only.
        env = (
            ("VLLM_RAY_BUNDLE_INDICES", ",".join(map(str, bundles))),
            ("VLLM_RAY_PER_WORKER_GPUS", f"{hybrid_share - GPU_SLIVER:.4f}"),
        )
        return EnginePlacement(num_cpus=hybrid_share, num_gpus=GPU_SLIVER, bundles=bundles, executor="ray", env=env)
    return EnginePlacement(num_cpus=hybrid_share, num_gpus=gpu * hybrid_share, bundles=bundles)


_FLAG_PREFIX = {"actor": "actor", "reference": "ref", "critic": "critic", "reward": "reward"}


class Demand(NamedTuple):
    """Devices the run asks for in one piece: `what` names it in flags; `placement_group` says whether its bundles
    form a placement group of the run (--placement_strategy places them), not engines of their own."""

    what: str
    count: int
    placement_group: bool = True


def device_demand(cfg: PPOConfig, ranks: dict[str, int], on_gpu: bool) -> list[Demand]:
    """What the run's placement asks the cluster for, one device (a GPU, or a CPU slot) per bundle: each pool, each
    group in no pool (`ranks`: role -> its ranks), and the engines in no pool, which take --vllm_tensor_parallel_size
    GPUs each (one CPU slot on CPU, where their workers are the engine's own processes). Pure, as `build_groups`
    places them."""
    v = cfg.vllm
    pools = colocation_pools(cfg, set(ranks) | {"engines"})
    pooled = {role for pool in pools for role in pool.members}
    demand = [
        Demand(f"{' + '.join(pool.members)} ({pool.name}: --actor_num_nodes x --actor_num_gpus_per_node)", pool.bundles)
        if pool.name in ("hybrid", "deepspeed")
        else Demand(f"{' + '.join(pool.members)} ({'--colocate_' + pool.name})", pool.bundles)
        for pool in pools
    ]
    for role, count in ranks.items():
        if role not in pooled:
            prefix = "teacher" if role.startswith("teacher") else _FLAG_PREFIX[role]
            demand.append(Demand(f"{role} (--{prefix}_num_nodes x --{prefix}_num_gpus_per_node)", count))
    if "engines" not in pooled:
        demand.append(
            Demand(
                "vLLM engines (--vllm_num_engines x --vllm_tensor_parallel_size)",
                v.vllm_num_engines * (v.vllm_tensor_parallel_size if on_gpu else 1),
                placement_group=False,
            )
        )
    return demand


# -- memory swapping at run time ---------------------------------------------------------------------------------------


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
