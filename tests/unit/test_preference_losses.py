"""Preference losses against hand-computed values."""

import math

import pytest
import torch

from openppo.algorithms.losses import dpo_loss, pairwise_rm_loss


def test_pairwise_sigmoid_hand_value():
    # chosen - rejected = 1 -> -log(sigmoid(1)) = log(1 + e^-1) = 0.313262
    loss = pairwise_rm_loss(torch.tensor([2.0]), torch.tensor([1.0]))
    assert loss.item() == pytest.approx(math.log1p(math.exp(-1.0)), abs=1e-6)


def test_pairwise_margin_shifts_the_gap():
    # margin 1 makes a gap of 1 count as 0: -log(sigmoid(0)) = log 2
    loss = pairwise_rm_loss(torch.tensor([2.0]), torch.tensor([1.0]), margin=1.0)
    assert loss.item() == pytest.approx(math.log(2.0), abs=1e-6)


def test_logexp_equals_sigmoid_without_margin():
    c, r = torch.randn(16, dtype=torch.float64), torch.randn(16, dtype=torch.float64)
    assert torch.allclose(pairwise_rm_loss(c, r, kind="logexp"), pairwise_rm_loss(c, r, kind="sigmoid"))


def test_dpo_hand_value_and_rewards():
    # h = (-1 - -3) - (-2 - -2) = 2; beta 0.5 -> -log sigmoid(1) = 0.313262
    loss, chosen_r, rejected_r = dpo_loss(
        torch.tensor([-1.0]), torch.tensor([-3.0]), torch.tensor([-2.0]), torch.tensor([-2.0]), beta=0.5
    )
    assert loss.item() == pytest.approx(math.log1p(math.exp(-1.0)), abs=1e-6)
    assert chosen_r.item() == pytest.approx(0.5)  # 0.5 * (-1 - -2)
    assert rejected_r.item() == pytest.approx(-0.5)  # 0.5 * (-3 - -2)


def test_cdpo_label_smoothing_hand_value():
    # h = 2, beta 0.5, eps 0.1: 0.9 * log(1+e^-1) + 0.1 * log(1+e^1)
    loss, _, _ = dpo_loss(
        torch.tensor([-1.0]),
        torch.tensor([-3.0]),
        torch.tensor([-2.0]),
        torch.tensor([-2.0]),
        beta=0.5,
        label_smoothing=0.1,
    )
    expected = 0.9 * math.log1p(math.exp(-1.0)) + 0.1 * math.log1p(math.exp(1.0))
    assert loss.item() == pytest.approx(expected, abs=1e-6)


def test_ipo_hand_value():
    # h = 2, beta 0.5 -> (2 - 1/(2*0.5))^2 = 1
    loss, _, _ = dpo_loss(
        torch.tensor([-1.0]), torch.tensor([-3.0]), torch.tensor([-2.0]), torch.tensor([-2.0]), beta=0.5, ipo=True
    )
    assert loss.item() == pytest.approx(1.0)


def test_dpo_gradient_flows_to_policy_only():
    pc = torch.tensor([-1.0], requires_grad=True)
    pr = torch.tensor([-3.0], requires_grad=True)
    rc = torch.tensor([-2.0], requires_grad=True)
    loss, chosen_r, _ = dpo_loss(pc, pr, rc.detach(), torch.tensor([-2.0]), beta=0.5)
    loss.backward()
    assert pc.grad.item() < 0 < pr.grad.item()  # raise chosen, lower rejected
    assert not chosen_r.requires_grad
