"""Supervised fine-tuning: next-token loss on response tokens only (padded or packed rows)."""

from __future__ import annotations

from typing import Any

import torch

from openppo.trainers.loop import SupervisedTrainer


def masked_nll(log_probs: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean negative log-likelihood over target tokens.

    `log_probs` [B, T-1] scores token t+1; `loss_mask` [B, T] marks target tokens, so it is shifted by one.
    Returns (loss, number of target tokens).
    """
    mask = loss_mask[:, 1:].to(log_probs.dtype)
    tokens = mask.sum()
    return -(log_probs * mask).sum() / tokens.clamp(min=1), tokens


class SFTTrainer(SupervisedTrainer):
    name = "sft"

    def compute_loss(self, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        out = self.engine(batch["input_ids"], batch.get("attention_mask"), batch.get("position_ids"))
        loss, tokens = masked_nll(out.log_probs, batch["loss_mask"])
        return loss, {"train/loss": loss.item(), "train/target_tokens": tokens.item()}
