"""Which model groups share devices: the colocation flags as a list of shared pools (pure; no Ray).

A pool is one placement group of `bundles` bundles (one device each: a GPU, or on CPU one worker slot); rank i of
every member group runs in bundle i and asks for `fraction` of it, so the members of a pool share each device.
Groups in no pool get a placement group of their own.

- `--colocate_all_models` (hybrid engine): actor, reference, critic, reward model and the vLLM engines in one pool
  of the actor's size (validation checks every member has that size).
- `--colocate_actor_ref`: actor + reference; `--colocate_critic_reward`: critic + reward model.
"""

from __future__ import annotations

from dataclasses import dataclass

from openppo.distributed.placement import colocated_fraction
from openppo.ppo.config import PPOConfig

ROLES = ("actor", "reference", "critic", "reward", "engines")


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
    unknown = present - set(ROLES)
    if unknown:
        raise ValueError(f"unknown roles {sorted(unknown)}")
    actor_size = res.actor_num_nodes * res.actor_num_gpus_per_node
    if res.colocate_all_models:
        return [Pool("hybrid", actor_size, tuple(r for r in ROLES if r in present))]
    pools = []
    if res.colocate_actor_ref and "reference" in present:
        pools.append(Pool("actor_ref", actor_size, ("actor", "reference")))
    if res.colocate_critic_reward and {"critic", "reward"} <= present:
        pools.append(Pool("critic_reward", res.critic_num_nodes * res.critic_num_gpus_per_node, ("critic", "reward")))
    return pools
