"""Worker classes the distributed tests start as Ray actors (an importable module: Ray pickles them by name).

torch is imported inside the methods that need it, so the light workers start in about a second.
"""

from __future__ import annotations

import logging
import os
import time

import ray

from openppo.distributed.worker import BaseWorker

logger = logging.getLogger("tests.distributed")


def setup_strategy(ds_cfg, *, train_batch_size: int, micro_batch_size: int, max_norm: float = 1.0, seed: int = 42):
    """A `DeepSpeedStrategy` for this rank, joined to the group's process group (every rank at once: the start is a
    rendezvous at MASTER_ADDR:MASTER_PORT)."""
    from openppo.strategy.deepspeed_strategy import DeepSpeedStrategy

    strategy = DeepSpeedStrategy(
        ds_cfg, train_batch_size=train_batch_size, micro_batch_size=micro_batch_size, max_norm=max_norm, seed=seed
    )
    strategy.setup_distributed()
    logger.info("process group ready: rank %d of %d", strategy.rank, strategy.world_size)
    return strategy


DIST_ENV = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "OMP_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES",
)


class ProbeWorker(BaseWorker):
    """Reports its environment and placement; fails on request."""

    def env(self, extra: tuple[str, ...] = ()) -> dict[str, str | None]:
        return {name: os.environ.get(name) for name in (*DIST_ENV, *extra)}

    def placement_group_id(self) -> str | None:
        return ray.get_runtime_context().get_placement_group_id()

    def echo(self, shard, *, tag: str = "") -> tuple[int, object, str]:
        return self.rank, shard, tag

    def raise_on(self, rank: int, message: str) -> int:
        logger.warning("rank %d about to check its batch", self.rank)
        if self.rank == rank:
            raise ValueError(message)
        return self.rank

    def exit_on(self, rank: int, wait_s: float) -> int:
        """Rank `rank` exits the process at once; the others wait as if blocked in a collective."""
        if self.rank == rank:
            print(f"rank {self.rank} exiting the process now", flush=True)
            os._exit(3)
        time.sleep(wait_s)
        return self.rank

    def raise_then_exit(self) -> None:
        """Rank 0 raises at once, rank 1 exits a moment later: the order a peer dying in a collective can give."""
        if self.rank == 0:
            raise RuntimeError("Connection reset by peer")
        time.sleep(0.3)
        os._exit(3)

    def sleep(self, seconds: float) -> int:
        print(f"rank {self.rank} going to sleep for {seconds} s", flush=True)
        time.sleep(seconds)
        return self.rank


class BrokenWorker(BaseWorker):
    """Its constructor fails on rank 1."""

    def __init__(self, message: str):
        super().__init__()
        if self.rank == 1:
            raise RuntimeError(message)


class TrainWorker(BaseWorker):
    """One DeepSpeed ZeRO-3 rank training the tiny model on a fixed toy batch."""

    def train(self, model_dir: str, num_steps: int) -> dict:
        import torch

        from openppo.models.actor import Actor
        from openppo.strategy.config import DeepSpeedConfig
        from tests.ppo.rank_helpers import train_engine

        t0 = time.monotonic()
        strategy = setup_strategy(
            DeepSpeedConfig(zero_stage=3, param_dtype="fp32", dist_timeout=120),
            train_batch_size=2 * self.world_size,
            micro_batch_size=2,
            max_norm=1.0,
            seed=0,
        )
        t_dist = time.monotonic()
        with strategy.zero3_init():
            actor = Actor.from_pretrained(model_dir, dtype=torch.float32)
        engine = train_engine(strategy, actor, lr=1e-2, steps=num_steps, min_lr_ratio=0.0)
        t_engine = time.monotonic()
        # The same batch on every rank: ZeRO-3 must then give every rank the same loss at every step.
        input_ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(0))
        attention_mask = torch.ones_like(input_ids)
        losses = []
        for _ in range(num_steps):
            loss = -engine(input_ids, attention_mask=attention_mask).log_probs.mean()
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        partitioned = all(hasattr(p, "ds_id") for p in engine.module.parameters())
        return {
            "losses": losses,
            "rank": strategy.rank,
            "world_size": strategy.world_size,
            "zero3_partitioned": partitioned,
            "init_process_group_s": t_dist - t0,
            "build_engine_s": t_engine - t_dist,
            "train_s": time.monotonic() - t_engine,
        }


class CollectiveWorker(BaseWorker):
    """Joins a gloo world, then rank `exit_rank` dies while the others enter an all-reduce it never joins."""

    def all_reduce_after_exit(self, exit_rank: int) -> float:
        import torch

        from openppo.strategy.config import DeepSpeedConfig

        setup_strategy(
            DeepSpeedConfig(zero_stage=0, param_dtype="fp32", dist_timeout=300),
            train_batch_size=self.world_size,
            micro_batch_size=1,
        )
        if self.rank == exit_rank:
            print(f"rank {self.rank} exiting before the all-reduce", flush=True)
            os._exit(3)
        t = torch.ones(1)
        torch.distributed.all_reduce(t)
        return float(t.item())
