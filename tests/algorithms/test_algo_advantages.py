"""GAE, returns and whitening against hand calculations."""

import pytest
import torch

from openppo.algorithms import advantage_moments, compute_advantages, compute_gae, compute_returns, whiten_advantages

DTYPES = [torch.float32, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES)
def test_gae_three_token_episode(dtype):
    # 3 response tokens + 1 padded position whose reward/value are garbage and must be ignored
    rewards = torch.tensor([[0.0, 0.0, 1.0, 5.0]], dtype=dtype)
    values = torch.tensor([[0.5, 0.6, 0.7, 9.0]], dtype=dtype)
    mask = torch.tensor([[1, 1, 1, 0]])
    adv, ret = compute_gae(rewards, values, mask, gamma=0.9, lambd=0.8)
    # gamma * lambd = 0.72; the value after the last token is 0
    # t=2: delta = 1 + 0.9*0 - 0.7 = 0.3;      A2 = 0.3
    # t=1: delta = 0 + 0.9*0.7 - 0.6 = 0.03;   A1 = 0.03 + 0.72*0.3 = 0.246
    # t=0: delta = 0 + 0.9*0.6 - 0.5 = 0.04;   A0 = 0.04 + 0.72*0.246 = 0.21712
    # returns = A + V = [0.71712, 0.846, 1.0]
    assert adv.dtype == dtype and ret.dtype == dtype
    torch.testing.assert_close(adv, torch.tensor([[0.21712, 0.246, 0.3, 0.0]], dtype=dtype))
    torch.testing.assert_close(ret, torch.tensor([[0.71712, 0.846, 1.0, 0.0]], dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gae_lambda_one_is_returns_minus_values(dtype):
    rewards = torch.tensor([[0.0, 0.0, 1.0, 5.0]], dtype=dtype)
    values = torch.tensor([[0.5, 0.6, 0.7, 9.0]], dtype=dtype)
    mask = torch.tensor([[1, 1, 1, 0]])
    adv, _ = compute_gae(rewards, values, mask, gamma=0.9, lambd=1.0)
    # G = [0.81, 0.9, 1.0]; A = G - V = [0.31, 0.3, 0.3]
    torch.testing.assert_close(adv, torch.tensor([[0.31, 0.3, 0.3, 0.0]], dtype=dtype))
    returns = compute_returns(rewards, mask, gamma=0.9)
    torch.testing.assert_close(returns, torch.tensor([[0.81, 0.9, 1.0, 0.0]], dtype=dtype))
    torch.testing.assert_close(adv, (returns - values) * mask)


def test_gae_lambda_zero_is_td_error():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.5, 0.6, 0.7]])
    adv, _ = compute_gae(rewards, values, torch.ones(1, 3), gamma=0.9, lambd=0.0)
    torch.testing.assert_close(adv, torch.tensor([[0.04, 0.03, 0.3]]))


def test_interior_masked_span_is_skipped():
    # tokens 0, 3 kept; 1, 2 are (say) a tool output: the recursion goes straight from 3 to 0
    rewards = torch.tensor([[0.0, 7.0, 7.0, 1.0]])
    values = torch.tensor([[0.5, 7.0, 7.0, 0.7]])
    mask = torch.tensor([[1, 0, 0, 1]])
    adv, _ = compute_gae(rewards, values, mask, gamma=0.9, lambd=0.8)
    # t=3: A = 1 - 0.7 = 0.3; t=0: delta = 0.9*0.7 - 0.5 = 0.13, A = 0.13 + 0.72*0.3 = 0.346
    torch.testing.assert_close(adv, torch.tensor([[0.346, 0.0, 0.0, 0.3]]))
    # gamma < 1 returns: t=3: 1; t=0: 0 + 0.9 * 1 = 0.9
    torch.testing.assert_close(compute_returns(rewards, mask, 0.9), torch.tensor([[0.9, 0.0, 0.0, 1.0]]))
    # gamma = 1 path (reverse cumsum) agrees
    torch.testing.assert_close(compute_returns(rewards, mask, 1.0), torch.tensor([[1.0, 0.0, 0.0, 1.0]]))


@pytest.mark.parametrize("dtype", DTYPES)
def test_whitening(dtype):
    adv = torch.tensor([[1.0, 2.0, 99.0], [3.0, 4.0, 5.0]], dtype=dtype)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    # kept: 1..5, mean 3, population var 2 -> (x - 3) / sqrt(2)
    out = whiten_advantages(adv, mask)
    s = 2**0.5
    expected = torch.tensor([[-2 / s, -1 / s, 0.0], [0.0, 1 / s, 2 / s]], dtype=dtype)
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected)
    # --no_advantage_std_norm: only centred
    centred = whiten_advantages(adv, mask, std_norm=False)
    torch.testing.assert_close(centred, torch.tensor([[-2.0, -1.0, 0.0], [0.0, 1.0, 2.0]], dtype=dtype))
    # moments of two shards summed (an all-reduce) give the same as the whole batch
    moments = advantage_moments(adv[:1], mask[:1]) + advantage_moments(adv[1:], mask[1:])
    torch.testing.assert_close(whiten_advantages(adv[1:], mask[1:], moments=moments), expected[1:])


def test_compute_advantages_dispatch():
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    # group estimators: A = G = reverse cumsum, no whitening
    adv, ret = compute_advantages("group_norm", rewards, mask)
    torch.testing.assert_close(adv, torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]]))
    torch.testing.assert_close(ret, adv)
    # reinforce whitens: kept values [1, 1, 1, -1, -1], mean 0.2, var 0.96
    adv, _ = compute_advantages("reinforce", rewards, mask)
    torch.testing.assert_close(adv[0, 0], torch.tensor(0.8 / 0.96**0.5))
    adv, _ = compute_advantages("gae", rewards, mask, values=torch.zeros(2, 3), whiten=False)
    torch.testing.assert_close(adv, torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]]))
    with pytest.raises(ValueError, match="needs gamma 1"):
        compute_advantages("rloo", rewards, mask, gamma=0.99)
    with pytest.raises(ValueError, match="lambd must be in"):
        compute_gae(rewards, rewards, mask, 1.0, 1.5)
    with pytest.raises(ValueError):
        compute_advantages("gae", rewards, mask)
