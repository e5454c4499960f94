"""The driver's typed handles on the model groups of a run, and how a batch is dealt to a group's ranks.

    PPOTrainer.step  --(ActorGroup.log_probs: deal rows, one Ray call per rank)-->  ActorWorker.log_probs
                     (openppo.ppo.workers, one per rank: micro-batches through the DeepSpeed engine -> Actor.forward)

Each handle method names the worker method it runs (`ActorWorker.train`, not a string), so an editor follows a call
from the step to the code that does the work. Rank i of a group gets the i-th shard: contiguous rows, or rows dealt
by tokens when micro-batches are costed by tokens (packing, token budgets). The K consecutive ranks of a ring
(--ring_attn_size) or of a tensor-parallel group (--ds_tensor_parallel_size) form one data-parallel rank and all
receive its shard; forward passes keep one result per such group.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from openppo.distributed.worker import BaseWorker
from openppo.distributed.worker_group import Method, WorkerGroup
from openppo.ppo.batching import in_batch_order, replicated, shard_rows, shards
from openppo.ppo.experience import collate_samples
from openppo.ppo.workers import (
    ActorWorker,
    CriticWorker,
    ReferenceWorker,
    RewardWorker,
    TeacherWorker,
    _TrainedWorker,
)
from openppo.rollout.pool import EnginePool, Sample

# -- the handles ------------------------------------------------------------------------------------------------------


class ModelGroup:
    """One model's ranks (a `WorkerGroup`), seen from the driver."""

    def __init__(self, workers: WorkerGroup, *, replicas: int = 1, balance: bool = False, share: bool = False):
        self.workers = workers
        self.replicas = replicas  # consecutive ranks holding the same rows (a ring, a tensor-parallel group)
        self.balance = balance  # deal rows by tokens (packing, token budgets)
        self.share = share  # deal whole groups, so that a group's prompt is computed once (--share_prompt_in_group)

    @property
    def num_workers(self) -> int:
        return self.workers.num_workers

    @property
    def worker_infos(self) -> list[dict[str, Any]]:
        return self.workers.worker_infos

    def forward(self, method: Method, data: dict[str, torch.Tensor]) -> torch.Tensor:
        """A forward-only pass over the whole batch; the result in the batch's row order."""
        rows = shard_rows(data, self.num_workers // self.replicas, self.balance, self.share)
        # the ranks of a ring or a tensor-parallel group return the same values: keep one per group
        return in_batch_order(
            self.workers.run_sharded(method, replicated(data, rows, self.replicas))[:: self.replicas], rows
        )

    def start_profile(self) -> None:
        self.workers.run(BaseWorker.start_profile)

    def stop_profile(self, out_dir: str) -> None:
        self.workers.run(BaseWorker.stop_profile, out_dir)

    def shutdown(self) -> None:
        self.workers.shutdown()


class TrainedGroup(ModelGroup):
    """A trained model's ranks: updates, checkpoints and state offload (every rank takes part in each)."""

    def fit(self, method: Method, data: dict[str, torch.Tensor], **kwargs) -> dict[str, float]:
        """One update on the batch: each data-parallel rank trains on its shard; the metrics, averaged over the
        ranks by the workers, come from rank 0."""
        return self.workers.run_sharded(
            method, shards(data, self.num_workers, self.balance, self.replicas, self.share), **kwargs
        )[0]

    def save_checkpoint(self, ckpt_dir: str, step: int, client_state: dict) -> None:
        self.workers.run(_TrainedWorker.save_checkpoint, ckpt_dir, step, client_state)

    def load_checkpoint(self, ckpt_dir: str, step: int) -> None:
        self.workers.run(_TrainedWorker.load_checkpoint, ckpt_dir, step)

    def offload_states(self) -> None:
        self.workers.run(_TrainedWorker.offload_states)

    def reload_states(self) -> None:
        self.workers.run(_TrainedWorker.reload_states)

    def save_hf(self, out_dir: str, tokenizer_path: str) -> None:
        self.workers.run(_TrainedWorker.save_hf, out_dir, tokenizer_path)


class ActorGroup(TrainedGroup):
    def __init__(self, workers: WorkerGroup, **kwargs):
        super().__init__(workers, **kwargs)
        # Held by the trainer from its first actor call of a step to the step's weight sync, and for checkpoints:
        # a replaced engine's sync from the rollout thread (--async_train) waits for it, so that it neither
        # interleaves its collectives with the step's nor sends weights that are newer than the version it names.
        self.lock = threading.RLock()

    def log_probs(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        """log pi(token t+1 | tokens <= t) [B, T-1] at the rollout temperature."""
        return self.forward(ActorWorker.log_probs, data)

    def log_probs_and_sampling(self, data: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(`log_probs`, the same under the engines' top-k/top-p truncation), from one pass."""
        both = self.forward(ActorWorker.log_probs_and_sampling, data)
        return both[..., 0], both[..., 1]

    def train(self, data: dict[str, torch.Tensor], kl_coef: float, global_step: int) -> dict[str, float]:
        return self.fit(ActorWorker.train, data, kl_coef=kl_coef, global_step=global_step)

    def connect_engines(
        self,
        engines: EnginePool,
        plan: Any,
        backend: str,
        tensor_parallel_size: int,
        *,
        bucket_bytes: int,
        engine_dtype: str,
        delta: bool = False,
    ) -> None:
        self.workers.run(
            ActorWorker.connect_engines,
            engines.engines,
            plan,
            backend,
            tensor_parallel_size,
            engines.timeout_s,
            bucket_bytes,
            engine_dtype,
            delta,
        )

    def sync_weights(self, engines: EnginePool, version: int) -> dict[str, Any]:
        """Every engine gets the current weights, as weight version `version`; no engine takes a decoding step
        meanwhile (a partial rollout's steps wait in the engine). Rank 0's sync statistics, or `{"failed":
        traceback}` when the sync failed on rank 0 (`ActorWorker.sync_weights`; `Groups.sync_engines` decides)."""
        with engines.lock:
            stats = self.workers.run(ActorWorker.sync_weights, version)[0]
            if "failed" not in stats:
                engines.stale.clear()
                engines.version = version
            return stats

    def check_engine_weights(self, engines: EnginePool) -> list[tuple[bool, str]]:
        """Per engine (equal, summary): the weights it computes with against the actor's (`rollout.readback`)."""
        with engines.lock:
            return self.workers.run(ActorWorker.check_engine_weights, engines.engines, engines.timeout_s)[0]


class CriticGroup(TrainedGroup):
    def values(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        """V(s_t) [B, T-1]."""
        return self.forward(CriticWorker.values, data)

    def train(self, data: dict[str, torch.Tensor], global_step: int) -> dict[str, float]:
        return self.fit(CriticWorker.train, data, global_step=global_step)


class ReferenceGroup(ModelGroup):
    def log_probs(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.forward(ReferenceWorker.log_probs, data)


class TeacherGroup(ModelGroup):
    def log_probs(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.forward(TeacherWorker.log_probs, data)


class RewardGroup(ModelGroup):
    """The reward model's ranks, and the run's scorer when it has no reward function (`collector.Scorer`)."""

    normalization: tuple[float, float] | None = None  # the reward model's saved (mean, std), set at start-up
    pad_token_id: int | None = None  # the tokenizer's, set when it becomes the run's scorer (`launch.rollout_parts`)

    def __init__(self, workers: WorkerGroup, **kwargs):
        super().__init__(workers, **kwargs)
        # the ranks run collectives: the rollout thread (--async_train) and eval must not interleave their calls
        self._lock = threading.Lock()

    def score(self, samples: list[Sample]) -> tuple[torch.Tensor, dict[str, float]]:
        """The reward model's raw score per sample [B], and no extra metrics."""
        assert self.pad_token_id is not None, "set pad_token_id before scoring samples"
        batch = collate_samples(samples, self.pad_token_id)
        with self._lock:
            return self.forward(RewardWorker.scores, {k: batch[k] for k in ("sequences", "attention_mask")}), {}


@dataclass
class Groups:
    """The model groups and engines the controller drives (None where the run does not need one: no actor when
    --eval_only evaluates --pretrain, `launch.evaluates_pretrain`)."""

    actor: ActorGroup | None
    engines: EnginePool
    critic: CriticGroup | None = None
    reference: ReferenceGroup | None = None
    reward: RewardGroup | None = None
    reward_source: Any = None  # a RewardSource when scoring is not done by a reward model
    link: Any = None  # the actor's connection to the engines (`launch.EngineLink`), rebuilt after a replacement
    placement_groups: list = field(default_factory=list)  # the shared ones the run made (removed at teardown)
    teachers: list[TeacherGroup] = field(default_factory=list)  # --teacher_pretrain, in its order

    def sync_engines(self, version: int) -> dict[str, float]:
        """Every engine gets the actor's current weights as weight version `version` (`ActorGroup.sync_weights`).
        An engine found dead before or during the sync is replaced (`EnginePool.replace_dead`, bounded by
        --max_engine_restarts), and the engines are connected anew after any replacement."""
        pool = self.engines
        with pool.lock:
            pool.replace_dead("before a weight sync")
            if self.link is not None:
                self.link.ensure()
            stats = self.actor.sync_weights(pool, version)
            if "failed" in stats and self.link is not None and pool.replace_dead("by a weight sync"):
                # an engine died during the sync: the new one joins, and everyone gets the weights once more
                self.link.ensure()
                stats = self.actor.sync_weights(pool, version)
            if "failed" in stats:  # no engine died: the sync itself failed
                raise RuntimeError(f"the weight sync failed on actor rank 0:\n{stats['failed']}")
            return stats

    def trained(self) -> list[TrainedGroup]:
        return [g for g in (self.actor, self.critic) if g is not None]

    def models(self) -> list[ModelGroup]:
        return [g for g in (self.actor, self.critic, self.reference, self.reward) if g is not None] + self.teachers
