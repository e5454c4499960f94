"""Group baselines, reward clipping/normalisation, length penalties and per-token placement, by hand."""

import pytest
import torch

from openppo.algorithms import (
    ADVANTAGE_ESTIMATORS,
    apply_truncation_penalty,
    clip_rewards,
    normalize_reward,
    overlong_penalty,
    shape_group_rewards,
    shape_sequence_rewards,
    token_level_rewards,
)

DTYPES = [torch.float32, torch.float64]


@pytest.mark.parametrize("dtype", DTYPES)
def test_grpo_and_rloo_on_1001(dtype):
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=dtype)
    # mean 0.5; unbiased std = sqrt(4 * 0.25 / 3) = 0.57735; 0.5 / (0.57735 + 1e-6) = 0.86602
    grpo = shape_group_rewards(rewards, 4, "group_norm")
    assert grpo.dtype == dtype
    torch.testing.assert_close(grpo, torch.tensor([0.8660, -0.8660, -0.8660, 0.8660], dtype=dtype), atol=5e-5, rtol=0)
    # RLOO: 1 - (0 + 0 + 1) / 3 = 0.6667; 0 - (1 + 0 + 1) / 3 = -0.6667
    rloo = shape_group_rewards(rewards, 4, "rloo")
    torch.testing.assert_close(rloo, torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3], dtype=dtype))
    # minus the group mean: +-0.5
    for estimator in ("reinforce_baseline", "dr_grpo"):
        torch.testing.assert_close(
            shape_group_rewards(rewards, 4, estimator), torch.tensor([0.5, -0.5, -0.5, 0.5], dtype=dtype)
        )
    for estimator in ("gae", "reinforce"):
        torch.testing.assert_close(shape_group_rewards(rewards, 4, estimator), rewards)


def test_two_groups_are_independent():
    # group 1 [3, 1] -> mean 2, std sqrt(2) = 1.41421: +-0.70711; group 2 [5, 5] -> 0
    shaped = shape_group_rewards(torch.tensor([3.0, 1.0, 5.0, 5.0]), 2, "group_norm")
    torch.testing.assert_close(shaped, torch.tensor([0.70711, -0.70711, 0.0, 0.0]), atol=1e-5, rtol=0)


@pytest.mark.parametrize("estimator", ADVANTAGE_ESTIMATORS)
@pytest.mark.parametrize("value", [0.0, 0.1, 7.3, -2.9])
def test_equal_rewards_give_exact_zero(estimator, value):
    rewards = torch.full((8,), value)
    shaped = shape_group_rewards(rewards, 4, estimator)
    assert torch.isfinite(shaped).all()
    if estimator not in ("gae", "reinforce"):
        assert (shaped == 0).all()


def test_group_errors():
    with pytest.raises(ValueError, match="needs n >= 2"):
        shape_group_rewards(torch.ones(4), 1, "rloo")
    with pytest.raises(ValueError, match="estimator='grpo' is not one of"):
        shape_group_rewards(torch.ones(4), 2, "grpo")
    with pytest.raises(ValueError):
        shape_group_rewards(torch.ones(5), 2, "rloo")


def test_overlong_penalty():
    lengths = torch.tensor([50, 80, 90, 100, 120])
    # expected = 100 - 20 = 80; exceed = clamp(len - 80, 0, 20) = [0, 0, 10, 20, 20]; penalty = -exceed/20 * 2
    # 90 is the middle of the buffer: -0.5 * factor = -1.0
    penalty = overlong_penalty(lengths, max_new_tokens=100, buffer_len=20, factor=2.0)
    assert penalty.tolist() == [0.0, 0.0, -1.0, -2.0, -2.0]
    with pytest.raises(ValueError, match="buffer_len must be in"):
        overlong_penalty(lengths, max_new_tokens=100, buffer_len=0)
    with pytest.raises(ValueError, match="factor must be >= 0"):
        overlong_penalty(lengths, max_new_tokens=100, buffer_len=10, factor=-1.0)


def test_truncation_clip_normalize():
    rewards = torch.tensor([2.0, 2.0, -1.0])
    truncated = torch.tensor([True, False, True])
    assert apply_truncation_penalty(rewards, truncated, 0.5).tolist() == [1.0, 2.0, -0.5]
    assert apply_truncation_penalty(rewards, truncated, -3.0).tolist() == [-3.0, 2.0, -3.0]
    with pytest.raises(ValueError, match="coef must be <= 1"):
        apply_truncation_penalty(rewards, truncated, 1.5)
    assert clip_rewards(torch.tensor([-20.0, 3.0, 20.0]), (-10.0, 10.0)).tolist() == [-10.0, 3.0, 10.0]
    with pytest.raises(ValueError, match="clip_range: low must be < high"):
        clip_rewards(rewards, (1.0, 1.0))
    # (r - 1) / 2
    assert normalize_reward(torch.tensor([3.0, -1.0]), 1.0, 2.0).tolist() == [1.0, -1.0]
    with pytest.raises(ValueError, match="std must be > 0"):
        normalize_reward(rewards, 0.0, 0.0)


def test_pipeline_order_clip_before_group_baseline():
    scores = torch.tensor([30.0, 0.0, 0.0, 0.0])
    # normalise (r - 0) / 2 = [15, 0, 0, 0]; clip to [-10, 10] -> [10, 0, 0, 0];
    # overlong (max 10, buffer 4): lengths [10, 8, 2, 2] -> exceed [4, 2, 0, 0] -> [-1, -0.5, 0, 0] -> [9, -0.5, 0, 0]
    # group mean (dr_grpo) = 8.5 / 4 = 2.125 -> [6.875, -2.625, -2.125, -2.125]
    shaped = shape_sequence_rewards(
        scores,
        estimator="dr_grpo",
        n_samples_per_prompt=4,
        reward_mean_std=(0.0, 2.0),
        reward_clip_range=(-10.0, 10.0),
        response_lengths=torch.tensor([10, 8, 2, 2]),
        max_new_tokens=10,
        overlong_buffer_len=4,
    )
    torch.testing.assert_close(shaped, torch.tensor([6.875, -2.625, -2.125, -2.125]))
    # the shaped group keeps a zero mean (a clip after the baseline would break it)
    assert abs(shaped.sum().item()) < 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
def test_token_level_rewards(dtype):
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
    kl = torch.tensor([[0.1, 0.2, 0.3, 9.0], [0.5, -0.5, 9.0, 9.0], [9.0, 9.0, 9.0, 9.0]], dtype=dtype)
    rewards = torch.tensor([1.0, 2.0, 3.0], dtype=dtype)
    # reward on the last kept token, minus 0.1 * kl on kept tokens; the all-masked row gets nothing
    out = token_level_rewards(rewards, mask, kl, kl_coef=0.1)
    expected = torch.tensor([[-0.01, -0.02, 1.0 - 0.03, 0.0], [-0.05, 2.0 + 0.05, 0.0, 0.0], [0.0] * 4], dtype=dtype)
    assert out.dtype == dtype
    torch.testing.assert_close(out, expected)
    # interior masked span: the reward still goes to the last kept token (index 3)
    out = token_level_rewards(torch.tensor([1.0]), torch.tensor([[1, 0, 0, 1, 0]]))
    assert out.tolist() == [[0.0, 0.0, 0.0, 1.0, 0.0]]
