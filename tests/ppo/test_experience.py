"""Rollout samples -> tensors -> advantages, checked by hand."""

from __future__ import annotations

import pytest
import torch

from openppo.ppo.config import AlgoConfig
from openppo.ppo.experience import collate_samples, compute_advantages_for_batch, training_rows
from openppo.rollout.pool import Sample


def _sample(prompt, response, group, finish="stop", action_mask=None):
    return Sample(
        prompt_ids=prompt,
        response_ids=response,
        rollout_log_probs=[-0.5] * len(response),
        finish_reason=finish,
        group=group,
        action_mask=action_mask,
    )


def test_collate_aligns_action_mask_with_log_prob_grid():
    batch = collate_samples([_sample([5, 6, 7], [8, 9], 0), _sample([5], [10, 11, 12], 0, "length")], pad_token_id=0)
    assert batch["sequences"].tolist() == [[5, 6, 7, 8, 9], [5, 10, 11, 12, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    # position t scores token t+1: row 0 response tokens are at 3, 4 -> positions 2, 3
    assert batch["action_mask"].tolist() == [[0, 0, 1, 1], [1, 1, 1, 0]]
    assert batch["rollout_log_probs"][0].tolist() == [0, 0, -0.5, -0.5]
    assert batch["truncated"].tolist() == [False, True]
    assert batch["response_length"].tolist() == [2, 3]


def test_env_feedback_tokens_are_masked_out():
    batch = collate_samples([_sample([1, 2], [3, 4, 5, 6], 0, action_mask=[1, 0, 0, 1])], pad_token_id=0)
    assert batch["action_mask"].tolist() == [[0, 1, 0, 0, 1]]


def test_each_trained_token_carries_the_version_that_sampled_it():
    tagged = _sample([1, 2], [3, 4, 5, 6], 0, action_mask=[1, 0, 0, 1])
    tagged.token_versions = [4, 5]  # an agent row: a sync landed between its two calls
    untagged = _sample([1], [7, 8], 0)
    untagged.policy_version = 3
    batch = collate_samples([tagged, untagged], pad_token_id=0)
    assert batch["versions"].tolist() == [[-1, 4, -1, -1, 5], [3, 3, -1, -1, -1]]
    rows, _ = training_rows([tagged], multiple=2)  # a padding row trains nothing, so it has no version
    assert collate_samples(rows, pad_token_id=0)["versions"][1].tolist() == [-1] * 5
    tagged.token_versions = [4]
    with pytest.raises(AssertionError, match="one weight version per trained token"):
        collate_samples([tagged], pad_token_id=0)


def test_grpo_advantages_on_the_grid():
    # one group of 4 with rewards 1,0,0,1 -> +-0.8660 on every response token (gamma 1, reward at the last token)
    samples = [_sample([1, 2], [3] * (k + 1), 0) for k in range(4)]
    batch = collate_samples(samples, pad_token_id=0)
    algo = AlgoConfig(advantage_estimator="group_norm", init_kl_coef=0.0)
    out = compute_advantages_for_batch(
        batch, torch.tensor([1.0, 0.0, 0.0, 1.0]), algo=algo, n_samples_per_prompt=4, generate_max_len=16, kl_coef=0.0
    )
    mask = batch["action_mask"].bool()
    for row, sign in enumerate([1, -1, -1, 1]):
        values = out["advantages"][row][mask[row]]
        assert torch.allclose(values, torch.full_like(values, sign * 0.8660), atol=1e-4)
    assert (out["advantages"][~mask] == 0).all()


def test_kl_penalty_enters_token_rewards():
    # reinforce, one sample, reward 1, k1 KL = log p - log p_ref = 0.5 on both tokens, beta 0.1
    batch = collate_samples([_sample([1], [2, 3], 0)], pad_token_id=0)
    algo = AlgoConfig(advantage_estimator="reinforce", init_kl_coef=0.1, kl_estimator="k1")
    log_probs = torch.tensor([[-1.0, -1.0]])
    ref = torch.tensor([[-1.5, -1.5]])
    out = compute_advantages_for_batch(
        batch,
        torch.tensor([1.0]),
        algo=algo,
        n_samples_per_prompt=1,
        generate_max_len=8,
        kl_coef=0.1,
        log_probs=log_probs,
        ref_log_probs=ref,
    )
    # token rewards: [-0.05, 1 - 0.05]; returns (gamma 1): [0.9, 0.95]
    assert out["token_rewards"][0].tolist() == pytest.approx([-0.05, 0.95])
    assert out["returns"][0].tolist() == pytest.approx([0.9, 0.95])
    # with --use_kl_loss the penalty leaves the reward
    algo.use_kl_loss = True
    out = compute_advantages_for_batch(
        batch,
        torch.tensor([1.0]),
        algo=algo,
        n_samples_per_prompt=1,
        generate_max_len=8,
        kl_coef=0.1,
        log_probs=log_probs,
        ref_log_probs=ref,
    )
    assert out["token_rewards"][0].tolist() == pytest.approx([0.0, 1.0])


@pytest.mark.parametrize("no_whiten", [False, True])
def test_gae_uses_values(no_whiten):
    # one 2-token response, reward 1, values [0.5, 0.25], gamma 1, lambda 1: G = [1, 1]
    batch = collate_samples([_sample([1], [2, 3], 0)], pad_token_id=0)
    algo = AlgoConfig(advantage_estimator="gae", init_kl_coef=0.0, no_advantage_whiten=no_whiten)
    out = compute_advantages_for_batch(
        batch,
        torch.tensor([1.0]),
        algo=algo,
        n_samples_per_prompt=1,
        generate_max_len=8,
        kl_coef=0.0,
        values=torch.tensor([[0.5, 0.25]]),
    )
    assert out["returns"][0].tolist() == pytest.approx([1.0, 1.0])
    # advantages = returns - values = [0.5, 0.75]; whitened over the batch (gae's default) unless
    # --no_advantage_whiten (Molt's --algo.advantage.no_whiten)
    adv = out["advantages"][0]
    if no_whiten:
        assert adv.tolist() == pytest.approx([0.5, 0.75])
    else:
        assert adv[1] > adv[0] and float(adv.mean()) == pytest.approx(0.0, abs=1e-6)


def test_no_whiten_keeps_the_reward_to_go():
    # reinforce: the reward-to-go itself, where the default whitening would centre the two responses' 1 and 3
    batch = collate_samples([_sample([1], [2], 0), _sample([1], [3], 1)], pad_token_id=0)
    algo = AlgoConfig(advantage_estimator="reinforce", init_kl_coef=0.0, no_advantage_whiten=True)
    out = compute_advantages_for_batch(
        batch, torch.tensor([1.0, 3.0]), algo=algo, n_samples_per_prompt=1, generate_max_len=8, kl_coef=0.0
    )
    assert out["advantages"][:, -1].tolist() == pytest.approx([1.0, 3.0])


def test_summary_table():
    from openppo.ppo.reporting import RunHistory, summary_table

    steps = [
        {"train/reward": r, "train/response_length": 10.0 - i, "timing/generate": 3.0, "timing/actor_train": 1.0}
        for i, r in enumerate([0.0, 0.2, 0.4, 0.6, 0.8, 1.0])
    ]
    table = summary_table(RunHistory.of(steps), window=2)
    assert "first 2 steps: 0.100" in table and "last 2 steps:  0.900" in table
    assert "generate" in table and "75%" in table and "10.0 -> 5.0" in table
    # with the step's wall time logged, shares are of the step, and the untimed rest shows as "idle"
    for h in steps:
        h["timing/step"] = 5.0
    table = summary_table(RunHistory.of(steps), window=2)
    assert "60%" in table and "20%" in table and "idle" in table
    assert table.splitlines()[-1].split() == ["step", "5.00"]
    # async: generation ran beside the step; it is marked and left out of the staged sum (no idle row here)
    for h in steps:
        h.update({"timing/wait_rollout": 1.0, "timing/old_logprob": 3.0})
    rows = {line.split("  ")[0].strip(): line for line in summary_table(RunHistory.of(steps), window=2).splitlines()}
    assert "generate (async)" in rows and "idle" not in rows
