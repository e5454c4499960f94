"""Per-token policy and value losses of PPO and its relatives (GSPO, DAPO clip-higher, dual clip, IS correction),
and the pairwise losses of the preference stages (reward model, DPO / IPO / cDPO).

Both losses return the *unreduced* per-token loss [B, T] (0 where masked) and a dict of detached scalar metrics;
`aggregate_loss` reduces the loss. Targets (old log-probs, rollout log-probs, advantages, old values, returns) are
detached here, so only the current policy's log-probs and the current values receive gradients.

Log ratios are clamped to [-20, 20] before exp (exp(20) ~ 4.9e8): a token the policy has moved far from would
otherwise give inf, and inf * 0 = NaN poisons the whole step. A clamped token gets no gradient, which loses nothing:
its ratio is far outside any clip range.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from openppo.algorithms.advantages import POLICY_LOSS_TYPES
from openppo.algorithms.reductions import bool_mask, check_arg, check_choice, check_same_shape, masked_mean

IS_CORRECTION_TYPES = ("tis", "icepop", "seq-mask-tis", "token-trunc", "seq-mask", "geo-mask")
LOG_RATIO_CLAMP = 20.0


def _zero(x: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=x.dtype, device=x.device)


def clip_bounds(eps_clip: float, eps_clip_low_high: tuple[float, float] | None = None) -> tuple[float, float]:
    """(low, high) of the ratio clip [1 - low, 1 + high]: `eps_clip_low_high` if given, else `eps_clip` twice."""
    return (eps_clip, eps_clip) if eps_clip_low_high is None else tuple(eps_clip_low_high)


def gspo_sequence_log_ratio(log_probs: torch.Tensor, old_log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log s_i = mean over kept tokens of (log pi - log pi_old), i.e. s_i = geometric mean of the token ratios.

    GSPO, Zheng et al. 2025, arXiv:2507.18071. Shapes: [B, T] -> [B]; gradient flows to `log_probs`; clamped to
    [-20, 20]; 0 for an all-masked row.
    """
    return masked_mean(log_probs - old_log_probs.detach(), mask, dim=-1).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def importance_weights(
    old_log_probs: torch.Tensor,
    rollout_log_probs: torch.Tensor,
    mask: torch.Tensor,
    correction: str,
    threshold: tuple[float, float],
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Weights that correct for the rollout engine (vLLM) sampling from a slightly different policy than the trainer.

    rho_t = pi_old(t) / pi_rollout(t) = exp(old - rollout), per token, detached; [low, high] = `threshold`.
        tis           w_t = clip(rho_t, low, high)                 truncated IS (Yao et al. 2025, "Your efficient
                                                                    RL framework secretly brings you off-policy RL
                                                                    training", blog post)
        icepop        w_t = rho_t * 1[low <= rho_t <= high]         tokens outside the band are dropped (IcePop)
        seq-mask-tis  w_t = clip(rho_t, low, high) * 1[low <= rho_seq <= high], rho_seq = exp(mean_t log rho_t):
                      whole responses whose geometric-mean ratio leaves the band are dropped, the rest are truncated IS.
        token-trunc   w_t = min(rho_t, high)                        only the upper tail is cut (Molt: token, trunc)
        seq-mask      w_t = rho_t * 1[low <= exp(sum_t log rho_t) <= high]   responses whose whole-sequence ratio
                      leaves the band are dropped, the rest keep their token ratios (Molt: seq, mask)
        geo-mask      w_t = rho_t * 1[low <= rho_seq <= high]       as seq-mask with the geometric mean rho_seq
                      (Molt: geo, mask); seq-mask-tis also truncates the kept tokens' ratios
    Shapes: [B, T] -> (weights [B, T], 0 where masked; metrics). Metrics: is_ratio_mean (mean applied weight),
    vllm_kl (k1 estimate of KL(pi_rollout || pi_old), sampled from the rollout), is_masked_ratio (tokens dropped).
    """
    check_choice("correction", correction, IS_CORRECTION_TYPES)
    low, high = threshold
    check_arg(0 <= low < high, f"threshold: need 0 <= low < high, got {threshold}")
    keep = bool_mask(mask)
    log_rho = (old_log_probs.detach() - rollout_log_probs.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    log_rho = torch.where(keep, log_rho, _zero(log_rho))
    rho = log_rho.exp()
    if correction in ("tis", "token-trunc"):
        weights = rho.clamp(low if correction == "tis" else None, high)
        dropped = torch.zeros_like(keep)
    elif correction == "icepop":
        dropped = (rho < low) | (rho > high)
        weights = torch.where(dropped, _zero(rho), rho)
    else:
        if correction == "seq-mask":  # the whole sequence's ratio, its log clamped like a token's
            log_rho_seq = log_rho.sum(dim=-1).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        else:
            log_rho_seq = masked_mean(log_rho, mask, dim=-1)
        rho_seq = log_rho_seq.exp().unsqueeze(-1)
        dropped = ((rho_seq < low) | (rho_seq > high)).expand_as(rho)
        weights = torch.where(dropped, _zero(rho), rho.clamp(low, high) if correction == "seq-mask-tis" else rho)
    weights = torch.where(keep, weights, _zero(weights))
    metrics = {
        "is_ratio_mean": masked_mean(weights, mask),
        "vllm_kl": masked_mean(-log_rho, mask),
        "is_masked_ratio": masked_mean((dropped & keep).to(rho.dtype), mask),
    }
    return weights, metrics


def policy_loss(
    log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_clip_low: float = 0.2,
    eps_clip_high: float = 0.2,
    dual_clip: float | None = None,
    loss_type: str = "ppo",
    rollout_log_probs: torch.Tensor | None = None,
    is_correction: str | None = None,
    is_threshold: tuple[float, float] = (0.5, 5.0),
    old_sampling_log_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate loss of PPO (Schulman et al. 2017, arXiv:1707.06347), GSPO and CISPO, per token.

        r_t   = pi(t) / pi_old(t)                         ppo
              = s_i = exp(mean_t log(pi / pi_old))        gspo (arXiv:2507.18071), the same for every token of i
        l_t   = -min(r_t A_t, clip(r_t, 1 - eps_clip_low, 1 + eps_clip_high) A_t)
                (asymmetric `--eps_clip_low_high`, DAPO clip-higher, arXiv:2503.14476)
        cispo (MiniMax-M1, arXiv:2506.13585): l_t = -sg(min(r_t, 1 + eps_clip_high)) A_t log pi(t): the IS weight
              is clipped, not the update, so every token keeps its gradient (eps_clip_low is not used)
        dual clip (`--dual_clip` c > 1, Ye et al. 2020, arXiv:1912.09729, not cispo), only where A_t < 0:
              l_t = min(l_t, -c A_t)   bounds the loss when r_t is far above 1 on a bad action
        IS correction (`--vllm_is_correction_type`, needs `rollout_log_probs`): l_t <- w_t l_t,
              w from `importance_weights`, for both loss types. The engine sampled from a top-k/top-p truncation
              of its policy; `old_sampling_log_probs` is pi_old under the same truncation
              (`openppo.algorithms.sampling`), so that w compares one distribution. Default: `old_log_probs`
              (no truncation).

    Shapes: log_probs, old_log_probs, advantages, mask (and rollout_log_probs) [B, T] -> (loss [B, T], no
    reduction, 0 where masked; metrics). Gradient flows to `log_probs` only. For GSPO, writing the sequence ratio
    on every token and aggregating with equal weight per token of a sequence (all modes of `aggregate_loss` do)
    gives the paper's gradient s_i A_i * mean_t grad log pi(t).
    Metrics (detached, means over kept tokens of this micro-batch): clip_ratio (tokens where the clipped branch
    is the active one), approx_kl (k3 estimate of KL(pi_old || pi)), dual_clip_ratio if dual clip is on, and
    the `importance_weights` metrics if IS correction is on.
    """
    check_choice("loss_type", loss_type, POLICY_LOSS_TYPES)
    check_same_shape(
        log_probs=log_probs,
        old_log_probs=old_log_probs,
        advantages=advantages,
        mask=mask,
        rollout_log_probs=rollout_log_probs,
        old_sampling_log_probs=old_sampling_log_probs,
    )
    bounds = f"eps_clip_low={eps_clip_low}, eps_clip_high={eps_clip_high}"
    check_arg(0 < eps_clip_low < 1 and eps_clip_high > 0, f"need 0 < eps_clip_low < 1 and eps_clip_high > 0: {bounds}")
    check_arg(dual_clip is None or dual_clip > 1, f"dual_clip must be > 1, got {dual_clip}")
    check_arg(dual_clip is None or loss_type != "cispo", "dual_clip bounds a clipped surrogate; cispo has none")
    keep = bool_mask(mask)
    old_log_probs = old_log_probs.detach()
    advantages = torch.where(keep, advantages.detach(), _zero(advantages))

    if loss_type in ("ppo", "cispo"):
        token_log_ratio = torch.where(keep, log_probs - old_log_probs, _zero(log_probs))
        log_ratio = token_log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    else:
        log_ratio = gspo_sequence_log_ratio(log_probs, old_log_probs, mask).unsqueeze(-1).expand_as(log_probs)
    ratio = log_ratio.exp()
    if loss_type == "cispo":
        # the ratio clipped above and stopped is a weight on the REINFORCE term: a clipped token keeps its gradient
        ceiling = 1 + eps_clip_high
        loss = -ratio.detach().clamp(max=ceiling) * advantages * torch.where(keep, log_probs, _zero(log_probs))
        metrics = {"clip_ratio": masked_mean((ratio > ceiling).to(ratio.dtype), mask).detach()}
    else:
        surrogate = ratio * advantages
        clipped_surrogate = ratio.clamp(1 - eps_clip_low, 1 + eps_clip_high) * advantages
        loss = -torch.minimum(surrogate, clipped_surrogate)
        metrics = {"clip_ratio": masked_mean((clipped_surrogate < surrogate).to(ratio.dtype), mask).detach()}
    if dual_clip is not None:
        dual_bound = -dual_clip * advantages
        dual_active = (advantages < 0) & (loss > dual_bound)
        loss = torch.where(dual_active, dual_bound, loss)
        metrics["dual_clip_ratio"] = masked_mean(dual_active.to(ratio.dtype), mask)
    if is_correction is not None:
        if rollout_log_probs is None:
            raise ValueError("policy_loss: IS correction needs rollout_log_probs (the rollout engine's log-probs)")
        behaviour_comparable = old_log_probs if old_sampling_log_probs is None else old_sampling_log_probs
        weights, is_metrics = importance_weights(
            behaviour_comparable, rollout_log_probs, mask, is_correction, is_threshold
        )
        loss = loss * weights
        metrics.update(is_metrics)
    loss = torch.where(keep, loss, _zero(loss))
    # k3 of KL(pi_old || pi) sampled from pi_old, with x = log(pi / pi_old): r - 1 - log r = expm1(x) - x.
    # Never negative and lower variance than the mean log ratio; per token, whatever the loss type.
    x = torch.where(keep, log_probs.detach() - old_log_probs, _zero(log_probs)).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    metrics["approx_kl"] = masked_mean(torch.expm1(x) - x, mask)
    return loss, metrics


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    value_clip: float | None = 0.5,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss (PPO2 baselines; `--value_clip`, default 0.5), per token.

        V_clip = V_old + clip(V - V_old, -value_clip, value_clip)
        l_t    = 0.5 * max((V - R)^2, (V_clip - R)^2)         (0.5 * (V - R)^2 when value_clip is None)

    Shapes: values, old_values, returns, mask [B, T] -> (loss [B, T], no reduction, 0 where masked; metrics).
    Gradient flows to `values` only. Metric: value_clip_ratio (tokens where the clipped term is the larger).
    """
    check_same_shape(values=values, old_values=old_values, returns=returns, mask=mask)
    keep = bool_mask(mask)
    returns = returns.detach()
    unclipped = (values - returns).square()
    metrics: dict[str, torch.Tensor] = {}
    if value_clip is None:
        loss = 0.5 * unclipped
    else:
        check_arg(value_clip > 0, f"value_clip must be > 0, got {value_clip}")
        old_values = old_values.detach()
        clipped = (old_values + (values - old_values).clamp(-value_clip, value_clip) - returns).square()
        loss = 0.5 * torch.maximum(unclipped, clipped)
        metrics["value_clip_ratio"] = masked_mean((clipped > unclipped).to(values.dtype), mask).detach()
    loss = torch.where(keep, loss, _zero(loss))
    return loss, metrics


# -- preference losses -------------------------------------------------------------------------------------------------
# All inputs are 1-D tensors over the B pairs of a micro-batch; each function returns the mean loss (a scalar)
# and per-pair tensors for metrics.

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
