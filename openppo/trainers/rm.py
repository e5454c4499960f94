"""Reward-model training: pairwise loss on (chosen, rejected) scores read at the last token."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler

from openppo.trainers.loop import SupervisedTrainer, move_to
from openppo.trainers.preference_losses import pairwise_rm_loss


class RewardModelTrainer(SupervisedTrainer):
    name = "rm"

    def __init__(self, *, loss: str, margin: float, **kwargs):
        super().__init__(**kwargs)
        self.loss_kind = loss
        self.margin = margin
        self._stats: dict[str, float] = {}

    def _scores(self, batch: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        scores = self._score_last(batch)
        half = scores.size(0) // 2
        return scores[:half], scores[half:]

    def _score_last(self, batch: dict[str, Any]) -> torch.Tensor:
        from openppo.models.scalar import last_token_index

        values = self.engine(batch["input_ids"], batch["attention_mask"])
        return values.gather(1, last_token_index(batch["attention_mask"]).unsqueeze(1)).squeeze(1)

    def compute_loss(self, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        chosen, rejected = self._scores(batch)
        loss = pairwise_rm_loss(chosen, rejected, kind=self.loss_kind, margin=self.margin)
        return loss, {
            "train/loss": loss.item(),
            "train/acc": (chosen > rejected).float().mean().item(),
            "train/chosen_reward": chosen.mean().item(),
            "train/rejected_reward": rejected.mean().item(),
            "train/margin": (chosen - rejected).mean().item(),
        }

    @torch.no_grad()
    def measure_score_stats(self) -> dict[str, float]:
        """Mean and std of the scores of all sequences (eval set, else train set), stored for --normalize_reward."""
        dataset = self.eval_dataset if self.eval_dataset is not None else self.train_dataset
        sampler = DistributedSampler(
            dataset, num_replicas=self.strategy.world_size, rank=self.strategy.rank, shuffle=False
        )
        loader = DataLoader(dataset, batch_size=self.micro, sampler=sampler, collate_fn=self.collate_fn)
        self.engine.eval()
        total = torch.zeros(3, dtype=torch.float64, device=self.strategy.device)
        for batch in loader:
            scores = self._score_last(move_to(batch, self.strategy.device)).double()
            total += torch.stack([scores.new_tensor(scores.numel()), scores.sum(), (scores**2).sum()])
        if self.strategy.world_size > 1:
            torch.distributed.all_reduce(total)
        n, s, ss = total.tolist()
        mean = s / max(n, 1)
        std = max((ss / max(n, 1) - mean**2), 0.0) ** 0.5
        return {"value_mean": mean, "value_std": std if std > 1e-8 else 1.0}

    def final_config(self) -> dict[str, Any]:
        if not self._stats:
            self._stats = self.measure_score_stats()
        return dict(self._stats)
