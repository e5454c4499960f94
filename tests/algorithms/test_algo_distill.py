"""On-policy distillation's advantages against hand-computed values and the reverse KL's exact gradient."""

import math

import pytest
import torch

from openppo.algorithms import compute_approx_kl, distillation_advantages, teacher_kl

DTYPES = [torch.float32, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES)
def test_advantage_is_the_teachers_log_prob_minus_the_students(dtype):
    teacher = torch.tensor([[-1.0, -2.0, -0.5, -math.inf], [-0.2, -3.0, -1.0, -1.0]], dtype=dtype)
    student = torch.tensor([[-1.5, -1.0, -0.5, -math.inf], [-0.7, -0.5, -2.0, -4.0]], dtype=dtype)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    advantages = distillation_advantages(teacher, student, mask)
    # row 0: -1 + 1.5, -2 + 1, -0.5 + 0.5, padding (inf - inf would be NaN) -> 0
    # row 1: -0.2 + 0.7, -3 + 0.5, -1 + 2, -1 + 4
    expected = torch.tensor([[0.5, -1.0, 0.0, 0.0], [0.5, -2.5, 1.0, 3.0]], dtype=dtype)
    torch.testing.assert_close(advantages, expected)
    assert advantages.dtype == dtype
    # the negated k1 estimate of KL(student || teacher), token by token
    k1 = compute_approx_kl(student, teacher, "k1", mask=mask, clamp=None)
    torch.testing.assert_close(advantages, -k1)
    # the logged reverse KL: the mean of log pi_S - log pi_T over the 7 sampled tokens: (-0.5 + 1 + 0 - 0.5 + 2.5 -
    # 1 - 3) / 7 = -1.5 / 7
    assert teacher_kl(teacher, student, mask).item() == pytest.approx(-1.5 / 7)


def test_task_advantage_is_added_with_its_coefficient():
    teacher = torch.tensor([[-1.0, -2.0, -0.5]])
    student = torch.tensor([[-1.5, -1.0, -0.5]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    task = torch.tensor([[0.8, 0.8, 0.8]])  # a response's group-normalised reward at every token
    # [0.5, -1.0] + 0.5 x [0.8, 0.8] = [0.9, -0.6]; the masked token stays 0
    mixed = distillation_advantages(teacher, student, mask, task_advantages=task, task_coef=0.5)
    torch.testing.assert_close(mixed, torch.tensor([[0.9, -0.6, 0.0]]))
    # coefficient 0: pure distillation
    alone = distillation_advantages(teacher, student, mask, task_advantages=task, task_coef=0.0)
    torch.testing.assert_close(alone, distillation_advantages(teacher, student, mask))


def test_policy_gradient_with_these_advantages_is_minus_the_reverse_kl_gradient():
    """Over a whole vocabulary (one token, every outcome y weighted by pi_S(y)), the policy-gradient step
    E_y[A(y) grad log pi_S(y)] with A = log pi_T - log pi_S equals -grad KL(pi_S || pi_T), exactly."""
    torch.manual_seed(0)
    student_logits = torch.randn(7, dtype=torch.float64, requires_grad=True)
    teacher_log_probs = torch.log_softmax(torch.randn(7, dtype=torch.float64), dim=-1)

    log_pi = torch.log_softmax(student_logits, dim=-1)
    kl = (log_pi.exp() * (log_pi - teacher_log_probs)).sum()
    (kl_grad,) = torch.autograd.grad(kl, student_logits)

    log_pi = torch.log_softmax(student_logits, dim=-1)
    advantages = distillation_advantages(teacher_log_probs[None], log_pi[None], torch.ones(1, 7))[0]
    assert not advantages.requires_grad  # a target, never differentiated
    surrogate = -(log_pi.detach().exp() * advantages * log_pi).sum()  # the policy-gradient loss, exact expectation
    (pg_grad,) = torch.autograd.grad(surrogate, student_logits)
    torch.testing.assert_close(pg_grad, kl_grad, rtol=1e-12, atol=1e-12)
    assert kl_grad.abs().max() > 1e-2  # the two policies differ: the check is not 0 == 0


def test_shapes_must_agree():
    with pytest.raises(ValueError, match="shape mismatch"):
        distillation_advantages(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match="shape mismatch"):
        distillation_advantages(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 3), task_advantages=torch.zeros(2))
