"""Ray resources: what the cluster has, and placement groups that fail loudly instead of waiting forever.

A placement group reserves `num_bundles` slots of `{CPU: c, GPU: g}` up front; worker `i` of a group runs in
bundle `i`. Colocation is nothing more than several worker groups (and vLLM engines) taking a fraction of the
same bundles: with bundles of one GPU, an actor group and a reference group that each ask for
`num_gpus_per_worker=colocated_fraction(2)` put rank `i` of both on the same GPU. On CPU the same is done with a
fraction of each bundle's CPU.

Ray never fails a placement group that cannot be satisfied: `pg.ready()` waits for ever (the hang users hit with
many vLLM engines). `make_placement_group` bounds that wait and reports what was asked for against what is free.
"""

from __future__ import annotations

import logging
import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # Ray is imported where it is used: the config imports the strategies, and Ray takes 1.5 s
    from ray.util.placement_group import PlacementGroup

logger = logging.getLogger(__name__)

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


def strategy_fits(strategy: str, bundles: int, per_node: list[int]) -> bool:
    """Whether a placement group of `bundles` one-device bundles can ever be placed with `strategy` on nodes of
    `per_node` devices each (all of them free): STRICT_SPREAD needs a node for each bundle, STRICT_PACK one node for
    them all; PACK and SPREAD fall back to any node with room."""
    if strategy == "STRICT_SPREAD":
        return sum(1 for count in per_node if count >= 1) >= bundles
    if strategy == "STRICT_PACK":
        return max(per_node, default=0) >= bundles
    return sum(per_node) >= bundles


def describe_nodes(ranks: dict[str, list[str]]) -> str:
    """Where each group's ranks (or engines) run, from {group: [node address of rank 0, rank 1, ...]}:
    `actor 10.0.0.1 [0 1], 10.0.0.2 [2 3]; engines 10.0.0.2 [0]`."""
    parts = []
    for name, nodes in ranks.items():
        on: dict[str, list[int]] = {}
        for rank, node in enumerate(nodes):
            on.setdefault(node, []).append(rank)
        parts.append(f"{name} " + ", ".join(f"{node} [{' '.join(map(str, r))}]" for node, r in on.items()))
    return "; ".join(parts)


class PlacementError(RuntimeError):
    """The cluster could not provide the requested resources in time."""


def device_resources() -> tuple[bool, int]:
    """`(use_gpu, num_devices)` of the connected cluster: its GPUs when it has any, otherwise its CPUs.

    Counts the cluster's total, not what is free now. A cluster started with fake `num_gpus` counts as a GPU one.
    """
    import ray

    total = ray.cluster_resources()
    num_gpus = int(total.get("GPU", 0))
    if num_gpus > 0:
        return True, num_gpus
    return False, int(total.get("CPU", 0))


def colocated_fraction(num_colocated: int) -> float:
    """The share of one bundle each of `num_colocated` colocated processes asks for (0.5 for 2, 0.3333 for 3).

    Rounded down to Ray's resource granularity (1e-4) so that the shares never add up to more than the bundle.
    """
    if num_colocated < 1:
        raise ValueError(f"num_colocated must be >= 1, got {num_colocated}")
    return math.floor(10_000 / num_colocated) / 10_000


def bundle(cpus: float, gpus: float) -> dict[str, float]:
    """One bundle's resources; zero entries are left out (Ray rejects a bundle of zeros)."""
    if cpus < 0 or gpus < 0:
        raise ValueError(f"bundle resources must be >= 0, got CPU={cpus} GPU={gpus}")
    spec = {k: float(v) for k, v in (("CPU", cpus), ("GPU", gpus)) if v > 0}
    if not spec:
        raise ValueError("a bundle needs some CPU or GPU: cpus_per_bundle and gpus_per_bundle are both 0")
    return spec


def describe_resources(resources: dict[str, float]) -> str:
    """`CPU=4, GPU=2` for the resources users care about (Ray also lists memory and node-id markers)."""
    keys = [k for k in ("CPU", "GPU") if k in resources] or sorted(k for k in resources if not k.startswith("node:"))
    return ", ".join(f"{k}={resources.get(k, 0):g}" for k in keys) or "nothing"


def make_placement_group(
    num_bundles: int,
    *,
    cpus_per_bundle: float = 1.0,
    gpus_per_bundle: float = 0.0,
    strategy: str = "PACK",
    timeout_s: float = 60.0,
    name: str = "",
) -> PlacementGroup:
    """Reserve `num_bundles` bundles of `{CPU: cpus_per_bundle, GPU: gpus_per_bundle}` and wait until they are.

    Raises `PlacementError` after `timeout_s` seconds, naming the request and what the cluster has free, and
    removes the half-made group so that it holds nothing afterwards.
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    if num_bundles < 1:
        raise ValueError(f"num_bundles must be >= 1, got {num_bundles}")
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown placement strategy {strategy!r}; use one of {', '.join(STRATEGIES)}")
    spec = bundle(cpus_per_bundle, gpus_per_bundle)
    pg = placement_group([dict(spec) for _ in range(num_bundles)], strategy=strategy, name=name)
    try:
        ray.get(pg.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(pg)
        wanted = {k: v * num_bundles for k, v in spec.items()}
        raise PlacementError(
            f"placement group {name or '(unnamed)'}: {num_bundles} x {{{describe_resources(spec)}}} "
            f"({describe_resources(wanted)} in all, strategy {strategy}) could not be placed within {timeout_s:g} s; "
            f"the cluster has {describe_resources(ray.cluster_resources())} in all and "
            f"{describe_resources(ray.available_resources())} free. Ask for fewer workers or GPUs per worker, "
            f"colocate groups on one placement group, or add nodes"
        ) from None
    logger.info(
        "placement group %s ready: %d x {%s} (%s)",
        name or pg.id.hex()[:8],
        num_bundles,
        describe_resources(spec),
        strategy,
    )
    return pg
