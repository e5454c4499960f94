"""On-policy distillation: each sampled token's advantage from a teacher's log-probability of it.

The student samples y ~ pi_S(. | x) and a teacher scores every sampled token. The student minimises the reverse KL
KL(pi_S || pi_T) on its own samples; at a sampled token y_t the single-sample estimate of its per-token term is
`log pi_S(y_t | x, y_<t) - log pi_T(y_t | x, y_<t)` (Schulman's k1). The advantage of y_t is the negation,
`log pi_T - log pi_S`, credited to that token alone (discount 0: a token is not charged for the teacher's view of
the tokens after it), as in on-policy distillation with the reverse KL (Agarwal et al. 2024, "On-Policy
Distillation of Language Models" (GKD), on-policy data; Lu and Thinking Machines 2025, "On-Policy Distillation").
For one token, the policy gradient with this advantage is exactly -grad KL(pi_S || pi_T)
(tests/algorithms/test_algo_distill.py checks it over a whole vocabulary).

With a task reward as well, the advantage adds the task's, weighted: A_t = (log pi_T - log pi_S)_t + c * A_task_t,
where A_task is the run's estimator's advantage (with group_norm, the response's normalised reward at every token).

Inputs are [B, T] tensors over response tokens with a 0/1 (bool or float) mask; masked positions may hold inf
(padding) and come out 0. Outputs are detached: they are policy-gradient targets.
"""

from __future__ import annotations

import torch

from openppo.algorithms.reductions import bool_mask, check_same_shape, masked_mean


def distillation_advantages(
    teacher_log_probs: torch.Tensor,
    student_log_probs: torch.Tensor,
    mask: torch.Tensor,
    *,
    task_advantages: torch.Tensor | None = None,
    task_coef: float = 0.0,
) -> torch.Tensor:
    """`log pi_T - log pi_S` at every sampled token, plus `task_coef` x `task_advantages` when given; 0 where
    masked. `student_log_probs` are the log-probs the samples were drawn with (or the trainer's recomputation of
    them), never ones that carry gradients: the result is detached."""
    check_same_shape(teacher_log_probs=teacher_log_probs, student_log_probs=student_log_probs, mask=mask)
    advantages = teacher_log_probs.detach() - student_log_probs.detach()
    if task_advantages is not None:
        check_same_shape(task_advantages=task_advantages, mask=mask)
        advantages = advantages + task_coef * task_advantages.detach()
    # where, not multiply: padding may hold inf log-probs, and inf * 0 is NaN
    return torch.where(bool_mask(mask), advantages, torch.zeros_like(advantages))


def teacher_kl(teacher_log_probs: torch.Tensor, student_log_probs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The mean over sampled tokens of the reverse-KL estimate `log pi_S - log pi_T` (a scalar): what distillation
    drives down, logged per teacher."""
    check_same_shape(teacher_log_probs=teacher_log_probs, student_log_probs=student_log_probs, mask=mask)
    return masked_mean(student_log_probs.detach() - teacher_log_probs.detach(), mask)
