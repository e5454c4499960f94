"""The advantage estimators and their defaults in one table (`--advantage_estimator`).

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
"""

from __future__ import annotations

from openppo.algorithms.masking import check_choice

ADVANTAGE_ESTIMATORS = ("gae", "reinforce", "rloo", "reinforce_baseline", "group_norm", "dr_grpo")
GROUP_ESTIMATORS = ("rloo", "reinforce_baseline", "group_norm", "dr_grpo")
WHITENED_ESTIMATORS = ("gae", "reinforce", "reinforce_baseline")
POLICY_LOSS_TYPES = ("ppo", "gspo")


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
