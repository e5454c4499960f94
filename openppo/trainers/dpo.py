"""DPO / IPO / cDPO training against a frozen reference model, with an optional NLL term on chosen responses."""

from __future__ import annotations

from typing import Any

import torch

from openppo.trainers.loop import SupervisedTrainer
from openppo.trainers.preference_losses import dpo_loss


def sequence_log_probs(out_log_probs: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed response log-probs per row and the response token counts ([B], [B])."""
    mask = loss_mask[:, 1:].to(out_log_probs.dtype)
    return (out_log_probs * mask).sum(-1), mask.sum(-1)


class DPOTrainer(SupervisedTrainer):
    name = "dpo"

    def __init__(self, *, ref_engine, beta: float, label_smoothing: float, ipo: bool, nll_loss_coef: float, **kwargs):
        super().__init__(**kwargs)
        self.ref_engine = ref_engine
        self.beta = beta
        self.label_smoothing = label_smoothing
        self.ipo = ipo
        self.nll_loss_coef = nll_loss_coef

    def compute_loss(self, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        ids, attn, loss_mask = batch["input_ids"], batch["attention_mask"], batch["loss_mask"]
        policy, lengths = sequence_log_probs(self.engine(ids, attn).log_probs, loss_mask)
        with torch.no_grad():
            ref, _ = sequence_log_probs(self.ref_engine(ids, attn).log_probs, loss_mask)
        half = ids.size(0) // 2
        loss, chosen_r, rejected_r = dpo_loss(
            policy[:half],
            policy[half:],
            ref[:half],
            ref[half:],
            beta=self.beta,
            label_smoothing=self.label_smoothing,
            ipo=self.ipo,
        )
        metrics = {"train/loss": loss.item()}
        if self.nll_loss_coef > 0:
            nll = -(policy[:half] / lengths[:half].clamp(min=1)).mean()
            loss = loss + self.nll_loss_coef * nll
            metrics["train/nll_loss"] = nll.item()
        metrics.update(
            {
                "train/chosen_reward": chosen_r.mean().item(),
                "train/rejected_reward": rejected_r.mean().item(),
                "train/margin": (chosen_r - rejected_r).mean().item(),
                "train/acc": (chosen_r > rejected_r).float().mean().item(),
            }
        )
        return loss, metrics
