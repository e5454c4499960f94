"""Ray-hosted ranks of the RL model groups: thin shells that build a role and forward the controller's calls."""

from __future__ import annotations

from typing import Any

import torch

from openppo.distributed.worker import BaseWorker
from openppo.ppo.config import PPOConfig
from openppo.utils.resources import trim_host_heap


class _TrainedWorker(BaseWorker):
    """Checkpoints and state offload, shared by the actor and critic ranks (all ranks call each: collectives)."""

    role: Any

    def save_checkpoint(self, ckpt_dir: str, step: int, client_state: dict) -> None:
        self.role.save_checkpoint(ckpt_dir, step, client_state)

    def load_checkpoint(self, ckpt_dir: str, step: int) -> None:
        self.role.load_checkpoint(ckpt_dir, step)

    def offload_states(self) -> bool:
        return self.role.offload_states()

    def reload_states(self) -> bool:
        return self.role.reload_states()


class PolicyWorker(_TrainedWorker):
    """One rank of the actor group; rank 0 also sends weights to the engines."""

    def init_role(self, cfg: PPOConfig, num_training_steps: int) -> None:
        from openppo.ppo.roles import PolicyRole

        self.role = PolicyRole(cfg, num_training_steps)
        self.sync_group = None
        self.sync_plan = None  # openppo.rollout.transport.SyncPlan, set by connect_engines
        self.exchange = None  # the hand-over exchange with the other exporting ranks, when there is one

    def log_probs(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.role.log_probs(data)

    def log_probs_and_sampling(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.role.log_probs_and_sampling(data)

    def train(self, data: dict[str, torch.Tensor], kl_coef: float, global_step: int) -> dict[str, float]:
        return self.role.train(data, kl_coef, global_step)

    def connect_engines(self, engines: list[Any], plan: Any, backend: str, tensor_parallel_size: int,
                        timeout_s: float) -> None:
        """Every rank enters. With `plan` (a `SyncPlan`) handing engines their buckets from several ranks, all ranks
        make the exchange group (a collective); rank 0 joins the broadcast group with the workers of the engines
        that get buckets by broadcast."""
        from openppo.rollout.sender import HandleExchange, connect_engines

        self.sync_plan = plan
        if plan.exchange_ranks:
            self.exchange = HandleExchange(plan.exchange_ranks, timeout_s)
        broadcast = [e for e, t in zip(engines, plan.transports) if t == "broadcast"]
        if self.role.strategy.rank == 0 and broadcast:
            self.sync_group = connect_engines(broadcast, backend=backend, tensor_parallel_size=tensor_parallel_size,
                                              timeout_s=timeout_s)

    def sync_weights(self, engines: list[Any], bucket_bytes: int, engine_dtype: str,
                     timeout_s: float) -> dict[str, float] | None:
        """Every rank enters (ZeRO-3 gathers are collectives); rank 0 sends and returns the stats."""
        from openppo.rollout.sender import sync_weights

        dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[engine_dtype]
        out = sync_weights(self.role.engine.module, self.sync_group, engines, bucket_bytes, dtype=dtype,
                           timeout_s=timeout_s, rank=self.role.strategy.rank, plan=self.sync_plan,
                           exchange=self.exchange)
        trim_host_heap()  # the buckets just freed
        return out

    def check_engine_weights(self, engines: list[Any], timeout_s: float) -> list[tuple[bool, str]]:
        """Every rank enters (the gathers are collectives); rank 0 returns per engine (equal, summary): each tensor
        the engine computes with against this trainer's gathered copy (`openppo.rollout.readback`)."""
        from openppo.rollout.readback import engine_weight_checks

        checks = engine_weight_checks(self.role.engine.module, engines, self.role.strategy.rank, timeout_s)
        return [(c.ok(), c.summary()) for c in checks]

    def save_hf(self, out_dir: str, tokenizer_path: str) -> None:
        from openppo.models.loading import load_tokenizer

        self.role.save_hf(load_tokenizer(tokenizer_path), out_dir)


class CriticWorker(_TrainedWorker):
    def init_role(self, cfg: PPOConfig, num_training_steps: int) -> None:
        from openppo.ppo.roles import CriticRole

        self.role = CriticRole(cfg, num_training_steps)

    def values(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.role.values(data)

    def train(self, data: dict[str, torch.Tensor], global_step: int) -> dict[str, float]:
        return self.role.train(data, global_step)


class ReferenceWorker(BaseWorker):
    def init_role(self, cfg: PPOConfig) -> None:
        from openppo.ppo.roles import ReferenceRole

        self.role = ReferenceRole(cfg)

    def log_probs(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.role.log_probs(data)


class RewardWorker(BaseWorker):
    def init_role(self, cfg: PPOConfig) -> tuple[float, float]:
        from openppo.ppo.roles import RewardRole

        self.role = RewardRole(cfg)
        return self.role.normalization

    def scores(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.role.scores(data)
