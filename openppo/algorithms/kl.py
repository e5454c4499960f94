"""KL between the policy and the reference model: per-token estimators, the KL loss term and the KL controllers.

The estimators are those of J. Schulman, "Approximating KL Divergence" (2020), http://joschu.net/blog/kl-approx.html,
for KL(pi || pi_ref) sampled from pi. With x = log pi - log pi_ref per token:

    k1 = x                      unbiased, high variance, can be negative; the natural per-token reward penalty
    k2 = x^2 / 2                biased, low variance; its gradient is the gradient of KL, the choice for a loss term
    k3 = exp(-x) - 1 + x        unbiased, low variance, always >= 0 ("low_var_kl" in verl)

KL enters training in one of two places (`--use_kl_loss`):
  * as a reward penalty: `-beta * k(x)` per token, added by `rewards.token_level_rewards` (detached);
  * as a loss term: `beta * aggregate(kl_loss(...))`, with a gradient through log pi only.

As a loss term no estimator's own gradient is that of KL(pi || pi_ref) in the loop as it runs: the tokens were
sampled from pi_old, not pi, and differentiated directly, E[grad k1] = 0, E[grad k3] = grad KL(pi_ref || pi) (the
forward KL), and k2's gradient is exact only while pi = pi_old. The reverse KL's gradient is
E_{pi_old}[w x grad log pi] with w = pi / pi_old, which `kl_loss(..., unbiased_gradient=True)` backpropagates
(`--kl_unbiased_gradient`; the DeepSeek-V3.2 report's correction of k3, OpenRLHF's `--algo.kl.unbiased_gradient`),
keeping the estimator's value for the loss and its log.
The coefficient beta comes from `FixedKLController` or, with `--kl_target`, `AdaptiveKLController`
(Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences", arXiv:1909.08593).
"""

from __future__ import annotations

import math

import torch

from openppo.algorithms.reductions import bool_mask, check_arg, check_choice, check_same_shape, masked_sum

KL_ESTIMATORS = ("k1", "k2", "k3")

# exp(20) ~ 4.9e8 is finite in fp32 and fp64; beyond it k3 would overflow to inf for a token whose reference
# log-prob is far above the policy's, and one inf token would turn the whole loss into NaN.
_LOG_RATIO_CLAMP = 20.0
# the unbiased gradient's importance weight pi / pi_old is capped: a token the update has made far likelier than it was
# at sampling (a rare, noisy estimate) pulls with at most this weight
KL_WEIGHT_MAX = 10.0


def compute_approx_kl(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    estimator: str = "k1",
    *,
    mask: torch.Tensor | None = None,
    clamp: float | None = 10.0,
) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) (Schulman 2020, see the module docstring).

    Shapes: log_probs, ref_log_probs, mask [B, T] -> [B, T], no reduction; masked positions are 0.
    Clamps (documented because they cut gradients): for k3 the log ratio x is first clamped to [-20, 20] so that
    exp(-x) stays finite; every estimator's result is then clamped to [-clamp, clamp] (10 by default, as in
    OpenRLHF and verl; None disables it). A saturated token has zero gradient.
    Gradients flow through both inputs; detach `ref_log_probs` yourself (or use `kl_loss`) for a loss term.
    """
    check_choice("estimator", estimator, KL_ESTIMATORS)
    check_same_shape(log_probs=log_probs, ref_log_probs=ref_log_probs, mask=mask)
    log_ratio = log_probs - ref_log_probs
    if estimator == "k1":
        kl = log_ratio
    elif estimator == "k2":
        kl = 0.5 * log_ratio.square()
    else:
        x = log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
        # expm1 keeps precision near x = 0, where the policies agree and k3 is a difference of nearly equal terms.
        kl = torch.expm1(-x) + x
    if clamp is not None:
        kl = kl.clamp(-clamp, clamp)
    if mask is not None:
        # where, not multiply: padding may hold inf log-probs, and inf * 0 is NaN.
        kl = torch.where(bool_mask(mask), kl, torch.zeros((), dtype=kl.dtype, device=kl.device))
    return kl


def kl_loss(
    log_probs: torch.Tensor,
    ref_log_probs: torch.Tensor,
    mask: torch.Tensor,
    estimator: str = "k3",
    *,
    unbiased_gradient: bool = False,
    old_log_probs: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token KL loss term, to be reduced by `aggregate_loss` and scaled by beta (`--use_kl_loss`).

    Shapes: [B, T] -> [B, T], no reduction, masked positions 0. Gradient flows to `log_probs` only; the reference
    is detached. k3 by default (verl's GRPO recipe); k2 gives the exact KL gradient on-policy (Schulman 2020).
    `unbiased_gradient`: the value stays the estimator's, the gradient becomes w * x * grad log pi (module
    docstring), x = log pi - log pi_ref clamped to [-20, 20], w = pi / pi_old from `old_log_probs` (detached, capped
    at KL_WEIGHT_MAX; 1 without them: the on-policy step, where pi_old = pi).
    """
    ref = ref_log_probs.detach()
    value = compute_approx_kl(log_probs, ref, estimator, mask=mask)
    if not unbiased_gradient:
        return value
    check_same_shape(log_probs=log_probs, old_log_probs=old_log_probs)
    coef = (log_probs.detach() - ref).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    if old_log_probs is not None:
        log_w = (log_probs.detach() - old_log_probs.detach()).clamp(max=math.log(KL_WEIGHT_MAX))
        coef = coef * log_w.exp()
    # masked before the product: padding may hold inf log-probs, and inf * 0 is NaN
    keep = bool_mask(mask)
    zero = torch.zeros((), dtype=log_probs.dtype, device=log_probs.device)
    surrogate = torch.where(keep, coef, zero) * torch.where(keep, log_probs, zero)
    return value.detach() + (surrogate - surrogate.detach())


def sequence_kl(kl: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Summed per-token KL of each response, [B, T] -> [B], detached: the statistic the adaptive controller tracks.

    Ziegler et al. (2019) state their target (e.g. 6 nats) per sequence, so the controller should be fed the
    mean over the batch of this value, and `--kl_target` is in nats per response.
    """
    return masked_sum(kl.detach(), mask, dim=-1)


class FixedKLController:
    """A constant KL coefficient beta (`--init_kl_coef`, used when `--kl_target` is unset)."""

    def __init__(self, init_kl_coef: float):
        check_arg(init_kl_coef >= 0, f"init_kl_coef must be >= 0, got {init_kl_coef}")
        self.value = float(init_kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op; present so both controllers share one interface."""

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


class AdaptiveKLController:
    """Proportional controller of Ziegler et al. (2019, arXiv:1909.08593).

    After each rollout batch: e = clip(KL / target - 1, -0.2, 0.2); beta <- beta * (1 + e * n_steps / horizon),
    where KL is the batch mean of `sequence_kl` (nats per response) and n_steps the number of responses in the batch.
    """

    def __init__(self, init_kl_coef: float, kl_target: float, kl_horizon: float = 10000):
        check_arg(init_kl_coef > 0, f"the adaptive controller needs init_kl_coef > 0, got {init_kl_coef}")
        check_arg(kl_target > 0, f"kl_target must be > 0 nats per response, got {kl_target}")
        check_arg(kl_horizon > 0, f"kl_horizon must be > 0, got {kl_horizon}")
        self.value = float(init_kl_coef)
        self.target = float(kl_target)
        self.horizon = float(kl_horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move beta towards the value that keeps `current_kl` at the target; the step is bounded by +-20%."""
        error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon

    def state_dict(self) -> dict[str, float]:
        return {"value": self.value}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.value = float(state["value"])


def build_kl_controller(
    init_kl_coef: float, kl_target: float | None = None, kl_horizon: float = 10000
) -> FixedKLController | AdaptiveKLController:
    """`AdaptiveKLController` when `--kl_target` is given, else `FixedKLController`."""
    if kl_target is None:
        return FixedKLController(init_kl_coef)
    return AdaptiveKLController(init_kl_coef, kl_target, kl_horizon)
