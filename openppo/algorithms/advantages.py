"""The advantage estimators with their defaults (`--advantage_estimator`), and the advantages and returns they
compute from per-token rewards: GAE, discounted returns, global whitening.

| estimator            | baseline on the scalar reward          | critic | global whitening | default loss aggregation |
|----------------------|----------------------------------------|--------|------------------|--------------------------|
| gae                  | learned value function (GAE)           | yes    | yes              | token-mean               |
| reinforce            | none (REINFORCE++)                     | no     | yes              | token-mean               |
| rloo                 | leave-one-out mean of the group        | no     | no               | token-mean               |
| reinforce_baseline   | group mean (REINFORCE++-baseline)      | no     | yes              | token-mean               |
| group_norm           | group mean, divided by group std (GRPO)| no     | no               | token-mean               |
| dr_grpo              | group mean, no std (Dr. GRPO)          | no     | no               | seq-mean-token-sum-norm  |

`--policy_loss_type gspo` overrides the aggregation default with seq-mean-token-mean: its ratio is per sequence,
so each sequence should weigh the same (Zheng et al. 2025, arXiv:2507.18071).
The group estimators need `--n_samples_per_prompt` >= 2 and `--gamma` 1 (the reward is per response, so
discounting it by the distance to the end would only favour short answers).
docs/algorithms.md gives each formula and how these choices compare with OpenRLHF, verl and TRL.

Advantages and returns. Inputs are [B, T] tensors over response tokens with a mask (bool or 0/1). Masked positions
are skipped, not treated as zero-reward steps: the recursions carry their state across them, so an interior masked
span (a tool output or user turn inside a multi-turn response) is as if absent, and right padding gives the usual
"value after the last response token is 0". Outputs are 0 at masked positions and always detached: advantages and
returns are regression and policy-gradient targets, never something to differentiate.
"""

from __future__ import annotations

import torch

from openppo.algorithms.reductions import bool_mask, check_arg, check_choice, check_same_shape

# -- the estimators --------------------------------------------------------------------------------------------------

ADVANTAGE_ESTIMATORS = ("gae", "reinforce", "rloo", "reinforce_baseline", "group_norm", "dr_grpo")
GROUP_ESTIMATORS = ("rloo", "reinforce_baseline", "group_norm", "dr_grpo")
WHITENED_ESTIMATORS = ("gae", "reinforce", "reinforce_baseline")
POLICY_LOSS_TYPES = ("ppo", "gspo", "cispo")


def check_advantage_estimator(estimator: str) -> None:
    """Raise ValueError for an unknown estimator name."""
    check_choice("estimator", estimator, ADVANTAGE_ESTIMATORS)


def needs_critic(estimator: str) -> bool:
    """True only for `gae`: the other estimators use a reward baseline, not a value model."""
    check_advantage_estimator(estimator)
    return estimator == "gae"


def whitens_by_default(estimator: str) -> bool:
    """Whether advantages are normalised over the whole rollout batch (`whiten_advantages`) for this estimator.

    The group estimators that already scale per group (group_norm, rloo, dr_grpo) are left alone: a second,
    global normalisation would undo Dr. GRPO's point (no std division) and rescale RLOO's unbiased estimate.
    """
    check_advantage_estimator(estimator)
    return estimator in WHITENED_ESTIMATORS


def default_loss_agg_mode(estimator: str, policy_loss_type: str = "ppo") -> str:
    """The loss aggregation used when `--loss_agg_mode` is not given (see the module table)."""
    check_advantage_estimator(estimator)
    check_choice("policy_loss_type", policy_loss_type, POLICY_LOSS_TYPES)
    if policy_loss_type == "gspo":
        return "seq-mean-token-mean"
    if estimator == "dr_grpo":
        return "seq-mean-token-sum-norm"
    return "token-mean"


# -- advantages and returns ------------------------------------------------------------------------------------------


def _check_discount(name: str, value: float) -> None:
    check_arg(0.0 <= value <= 1.0, f"{name} must be in [0, 1], got {value}")


def _zero(x: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=x.dtype, device=x.device)


@torch.no_grad()
def compute_gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0, lambd: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016, arXiv:1506.02438).

        delta_t = r_t + gamma * V_{t+1} - V_t          (V after the last response token = 0)
        A_t     = delta_t + gamma * lambd * A_{t+1}
        R_t     = A_t + V_t                             (the critic's target)

    Shapes: rewards, values, mask [B, T] -> (advantages [B, T], returns [B, T]); no reduction; detached; 0 where
    masked. With lambd = 1, A_t is the discounted return minus V_t; with lambd = 0 it is the one-step TD error.
    """
    check_same_shape(rewards=rewards, values=values, mask=mask)
    _check_discount("gamma", gamma)
    _check_discount("lambd", lambd)
    keep = bool_mask(mask)
    rewards = torch.where(keep, rewards, _zero(rewards))
    values = torch.where(keep, values, _zero(values)).to(rewards.dtype)
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])
    next_advantage = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lambd * next_advantage
        k = keep[:, t]
        advantages[:, t] = torch.where(k, advantage, _zero(advantage))
        # A masked step leaves the recursion state untouched, so the next kept token sees the right V and A.
        next_advantage = torch.where(k, advantage, next_advantage)
        next_value = torch.where(k, values[:, t], next_value)
    return advantages, advantages + values


@torch.no_grad()
def compute_returns(rewards: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """Discounted reward-to-go G_t = r_t + gamma * G_{t+1} (REINFORCE, Williams 1992; REINFORCE++, arXiv:2501.03262).

    Shapes: rewards, mask [B, T] -> [B, T]; no reduction; detached; 0 where masked.
    """
    check_same_shape(rewards=rewards, mask=mask)
    _check_discount("gamma", gamma)
    keep = bool_mask(mask)
    rewards = torch.where(keep, rewards, _zero(rewards))
    if gamma == 1.0:
        # Undiscounted: a reversed cumulative sum, no Python loop over T.
        returns = rewards.flip(-1).cumsum(-1).flip(-1)
        return torch.where(keep, returns, _zero(returns))
    returns = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        k = keep[:, t]
        running = torch.where(k, rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(k, running, _zero(running))
    return returns


@torch.no_grad()
def advantage_moments(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(count, sum, sum of squares) of the kept advantages, in fp64, shape [3].

    All-reduce (sum) this over data-parallel ranks before `whiten_advantages(..., moments=...)` to whiten with the
    statistics of the whole rollout batch. fp64 because var = E[x^2] - E[x]^2 cancels badly in fp32.
    """
    keep = bool_mask(mask)
    x = torch.where(keep, advantages, _zero(advantages)).double()
    return torch.stack([keep.sum().double(), x.sum(), x.square().sum()])


@torch.no_grad()
def whiten_advantages(
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    std_norm: bool = True,
    moments: torch.Tensor | None = None,
    eps: float = 1e-8,
) -> torch.Tensor:
    """Global advantage normalisation: (A - mean) / sqrt(max(var, eps)), statistics over all kept tokens.

    Shapes: advantages, mask [B, T] -> [B, T]; detached; 0 where masked. `moments` are the (possibly all-reduced)
    `advantage_moments`; None uses this tensor's own. var is the population variance. `std_norm=False`
    (`--no_advantage_std_norm`) only subtracts the mean, keeping the advantage scale (and so the reward's units).
    """
    check_same_shape(advantages=advantages, mask=mask)
    if moments is None:
        moments = advantage_moments(advantages, mask)
    count, total, total_sq = moments.to(device=advantages.device, dtype=torch.float64).unbind()
    count = count.clamp(min=1)
    mean = total / count
    out = advantages.double() - mean
    if std_norm:
        var = (total_sq / count - mean.square()).clamp(min=0)
        out = out * var.clamp(min=eps).rsqrt()
    out = out.to(advantages.dtype)
    return torch.where(bool_mask(mask), out, _zero(out))


@torch.no_grad()
def compute_advantages(
    estimator: str,
    token_rewards: torch.Tensor,
    mask: torch.Tensor,
    *,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lambd: float = 1.0,
    whiten: bool | None = None,
    std_norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advantages and returns for any `--advantage_estimator`, from the per-token rewards of `token_level_rewards`.

    gae: `compute_gae(token_rewards, values, ...)`. Every other estimator: A_t = G_t = `compute_returns` (the group
    baseline was already applied to the scalar reward by `shape_group_rewards`), returns = G.
    Then, if `whiten` (default: `whitens_by_default(estimator)`), `whiten_advantages` over this batch. For whitening
    across data-parallel ranks pass `whiten=False` and call `whiten_advantages` with all-reduced moments yourself.
    Shapes: [B, T] -> ([B, T], [B, T]); detached.
    """
    check_advantage_estimator(estimator)
    if estimator in GROUP_ESTIMATORS and gamma != 1.0:
        raise ValueError(f"{estimator} needs gamma 1 (the reward is per response), got {gamma}")
    if estimator == "gae":
        if values is None:
            raise ValueError("compute_advantages: estimator 'gae' needs the critic's values")
        advantages, returns = compute_gae(token_rewards, values, mask, gamma, lambd)
    else:
        returns = compute_returns(token_rewards, mask, gamma)
        advantages = returns.clone()
    if whitens_by_default(estimator) if whiten is None else whiten:
        advantages = whiten_advantages(advantages, mask, std_norm=std_norm)
    return advantages, returns
