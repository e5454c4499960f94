"""The RL math of openppo as pure torch functions: rewards, advantages, KL, policy/value losses, aggregation.

Nothing here imports ray, deepspeed or vllm; every function works on CPU, in fp32 and fp64, on [B, T] tensors
with a 0/1 (bool or float) response mask. docs/algorithms.md lists each formula, its flag and its default.

A PPO/GRPO step, in order:
    kl      = compute_approx_kl(old_log_probs, ref_log_probs, "k1", mask=mask)       # unless --use_kl_loss
    r       = shape_sequence_rewards(scores, estimator=..., n_samples_per_prompt=..., ...)
    R       = token_level_rewards(r, mask, kl, kl_ctl.value)
    A, G    = compute_advantages(estimator, R, mask, values=values, gamma=..., lambd=...)
    loss, m = policy_loss(log_probs, old_log_probs, A, mask, ...)
    L       = aggregate_loss(loss, mask, default_loss_agg_mode(estimator), num_tokens_global=...)
"""

from openppo.algorithms.advantages import (
    ADVANTAGE_ESTIMATORS,
    GROUP_ESTIMATORS,
    POLICY_LOSS_TYPES,
    WHITENED_ESTIMATORS,
    advantage_moments,
    compute_advantages,
    compute_gae,
    compute_returns,
    default_loss_agg_mode,
    needs_critic,
    whiten_advantages,
    whitens_by_default,
)
from openppo.algorithms.distill import distillation_advantages, teacher_kl
from openppo.algorithms.entropy import entropy_from_logits, log_probs_and_entropy, log_probs_from_logits
from openppo.algorithms.kl import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    build_kl_controller,
    compute_approx_kl,
    kl_loss,
    sequence_kl,
)
from openppo.algorithms.losses import (
    IS_CORRECTION_TYPES,
    clip_bounds,
    gspo_sequence_log_ratio,
    importance_weights,
    policy_loss,
    value_loss,
)
from openppo.algorithms.reductions import LOSS_AGG_MODES, aggregate_loss, loss_normalizers, masked_mean, masked_sum
from openppo.algorithms.rewards import (
    GRPO_STD_EPS,
    apply_truncation_penalty,
    clip_rewards,
    normalize_reward,
    overlong_penalty,
    shape_group_rewards,
    shape_sequence_rewards,
    token_level_rewards,
)
from openppo.algorithms.sampling import (
    SamplingFilter,
    engine_gap,
    sampling_log_probs,
)

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "GROUP_ESTIMATORS",
    "WHITENED_ESTIMATORS",
    "KL_ESTIMATORS",
    "POLICY_LOSS_TYPES",
    "IS_CORRECTION_TYPES",
    "LOSS_AGG_MODES",
    "GRPO_STD_EPS",
    "compute_approx_kl",
    "distillation_advantages",
    "teacher_kl",
    "kl_loss",
    "sequence_kl",
    "FixedKLController",
    "AdaptiveKLController",
    "build_kl_controller",
    "compute_gae",
    "compute_returns",
    "compute_advantages",
    "advantage_moments",
    "whiten_advantages",
    "shape_group_rewards",
    "shape_sequence_rewards",
    "normalize_reward",
    "clip_rewards",
    "overlong_penalty",
    "apply_truncation_penalty",
    "token_level_rewards",
    "policy_loss",
    "value_loss",
    "gspo_sequence_log_ratio",
    "importance_weights",
    "clip_bounds",
    "aggregate_loss",
    "loss_normalizers",
    "default_loss_agg_mode",
    "needs_critic",
    "whitens_by_default",
    "entropy_from_logits",
    "log_probs_and_entropy",
    "log_probs_from_logits",
    "masked_mean",
    "masked_sum",
    "SamplingFilter",
    "engine_gap",
    "sampling_log_probs",
]
