"""The supervised stages: each a `SupervisedTrainer` (openppo.trainers.loop) with its own loss on a micro-batch.

- SFT: next-token loss on the response tokens only (padded or packed rows).
- Reward model: pairwise loss on the (chosen, rejected) scores read at the last token; measures the score mean and
  std saved with the model for --normalize_reward.
- DPO / IPO / cDPO: against a frozen reference model, with an optional NLL term on the chosen responses.

The losses themselves are pure functions in openppo.algorithms.losses.
"""

from __future__ import annotations

from typing import Any

import torch

from openppo.algorithms.losses import dpo_loss, pairwise_rm_loss
from openppo.models.scalar import last_token_index
from openppo.trainers.loop import SupervisedTrainer, move_to

# -- SFT ----------------------------------------------------------------------------------------------------------


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
        out = self.engine(
            batch["input_ids"],
            batch.get("attention_mask"),
            batch.get("position_ids"),
            return_aux_loss=self.aux_loss_coef > 0,
            images=batch.get("images"),  # image samples (--image_key): the actor makes them its pixel inputs
        )
        loss, tokens = masked_nll(out.log_probs, batch["loss_mask"])
        metrics = {"train/loss": loss.item(), "train/target_tokens": tokens.item()}
        return self.add_aux_loss(loss, metrics, out.aux_loss), metrics


# -- reward model -------------------------------------------------------------------------------------------------


class RewardModelTrainer(SupervisedTrainer):
    name = "rm"

    def __init__(self, *, loss: str, margin: float, **kwargs):
        super().__init__(**kwargs)
        self.loss_kind = loss
        self.margin = margin
        self._stats: dict[str, float] = {}

    def _score_last(self, batch: dict[str, Any], aux: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The score of each row at its last token, and with `aux` the router's load-balancing loss."""
        out = self.engine(batch["input_ids"], batch["attention_mask"], return_aux_loss=aux)
        values, aux_loss = out if aux else (out, None)
        return values.gather(1, last_token_index(batch["attention_mask"]).unsqueeze(1)).squeeze(1), aux_loss

    def compute_loss(self, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        scores, aux_loss = self._score_last(batch, aux=self.aux_loss_coef > 0)
        half = scores.size(0) // 2
        chosen, rejected = scores[:half], scores[half:]
        margin = batch["margin"] if "margin" in batch else self.margin  # per pair with --margin_loss
        loss = pairwise_rm_loss(chosen, rejected, kind=self.loss_kind, margin=margin)
        metrics = {
            "train/loss": loss.item(),
            "train/acc": (chosen > rejected).float().mean().item(),
            "train/chosen_reward": chosen.mean().item(),
            "train/rejected_reward": rejected.mean().item(),
            "train/margin": (chosen - rejected).mean().item(),
        }
        return self.add_aux_loss(loss, metrics, aux_loss), metrics

    @torch.no_grad()
    def measure_score_stats(self) -> dict[str, float]:
        """Mean and std of the scores of all sequences (eval set, else train set), stored for --normalize_reward."""
        dataset = self.eval_dataset if self.eval_dataset is not None else self.train_dataset
        loader = self.data_loader(dataset, self.shard(dataset))
        self.engine.eval()
        total = torch.zeros(3, dtype=torch.float64, device=self.strategy.device)
        for batch in loader:
            scores = self._score_last(move_to(batch, self.strategy.device))[0].double()
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


# -- DPO ----------------------------------------------------------------------------------------------------------


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
        out = self.engine(ids, attn, return_aux_loss=self.aux_loss_coef > 0)
        policy, lengths = sequence_log_probs(out.log_probs, loss_mask)
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
        return self.add_aux_loss(loss, metrics, out.aux_loss), metrics
