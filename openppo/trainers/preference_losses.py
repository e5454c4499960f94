"""Pure losses of the preference stages: pairwise reward-model losses and DPO / IPO / cDPO.

All inputs are 1-D tensors over the B pairs of a micro-batch; each function returns the mean loss (a scalar)
and per-pair tensors for metrics.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

RM_LOSSES = ("sigmoid", "logexp")


def pairwise_rm_loss(
    chosen: torch.Tensor, rejected: torch.Tensor, *, kind: str = "sigmoid", margin: torch.Tensor | float = 0.0
) -> torch.Tensor:
    """Bradley-Terry pairwise loss (Ouyang et al. 2022, eq. 1), mean over pairs.

    sigmoid: -log sigmoid(r_c - r_r - margin)   (the margin of Touvron et al. 2023, Llama 2, sec. 3.2.2)
    logexp:  log(1 + exp(r_r - r_c))            (the same function written without a margin; kept for recipes
                                                 that name it)
    """
    if kind == "sigmoid":
        return -F.logsigmoid(chosen - rejected - margin).mean()
    if kind == "logexp":
        return torch.log1p(torch.exp(rejected - chosen)).mean()
    raise ValueError(f"unknown reward-model loss {kind!r}")


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    *,
    beta: float,
    label_smoothing: float = 0.0,
    ipo: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DPO (Rafailov et al. 2023, eq. 7), conservative DPO (label smoothing) and IPO (Azar et al. 2023, eq. 17).

    Inputs are summed response log-probs per sequence, shape [B]. Let
    h = (log pi(y_c) - log pi(y_r)) - (log ref(y_c) - log ref(y_r)).
      DPO/cDPO: -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)
      IPO:      (h - 1 / (2 beta))^2
    Returns (mean loss, chosen implicit rewards beta (log pi - log ref) [B], rejected rewards [B]); rewards detached.
    """
    h = (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)
    if ipo:
        losses = (h - 1.0 / (2.0 * beta)) ** 2
    else:
        losses = -F.logsigmoid(beta * h) * (1.0 - label_smoothing) - F.logsigmoid(-beta * h) * label_smoothing
    chosen_rewards = beta * (policy_chosen - ref_chosen).detach()
    rejected_rewards = beta * (policy_rejected - ref_rejected).detach()
    return losses.mean(), chosen_rewards, rejected_rewards
