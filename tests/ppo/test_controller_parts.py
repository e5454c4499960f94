"""Pure pieces of the RL controller: prompt order and resume position, DAPO group filter, pass@k, colocation."""

from __future__ import annotations

import pytest
import torch

from openppo.config.schema import parse_config
from openppo.ppo.colocation import colocation_pools
from openppo.ppo.config import PPOConfig
from openppo.ppo.evaluation import eval_metrics, pass_at_k
from openppo.ppo.groups_filter import expand_to_samples, keep_groups
from openppo.ppo.prompt_stream import PromptStream


def test_prompt_stream_order_and_resume():
    stream = PromptStream(10, rollout_batch_size=4, num_episodes=2, seed=3)
    assert stream.per_episode == 8 and stream.total == 16  # 2 prompts of each permutation are skipped
    first = stream.take(4) + stream.take(4)
    assert len(set(first)) == 8 and stream.episode == 1
    second = stream.take(8)
    assert len(set(second)) == 8 and second != first  # a new permutation per episode
    assert stream.take(4) == [] and stream.remaining() == 0
    # Resuming at any cursor continues exactly like the unbroken stream.
    unbroken = PromptStream(10, rollout_batch_size=4, num_episodes=2, seed=3)
    full = unbroken.take(16)
    for cursor in (0, 3, 8, 13):
        resumed = PromptStream(10, rollout_batch_size=4, num_episodes=2, seed=3)
        resumed.load_state_dict({"cursor": cursor, "per_episode": 8})
        assert resumed.take(16) == full[cursor:]
    assert PromptStream(10, rollout_batch_size=4, num_episodes=1, seed=4).take(8) != full[:8]  # the seed matters
    with pytest.raises(ValueError, match="--rollout_batch_size"):
        resumed.load_state_dict({"cursor": 0, "per_episode": 6})


def test_keep_groups_dapo_rule():
    scores = torch.tensor([0, 0, 0, 1, 1, 1, 0, 1, 0.5, 0.5, 0.2, 0.2])  # groups of 2
    keep = keep_groups(scores, 2, (0.0, 1.0))
    # means 0, 0.5, 1, 0.5, 0.5, 0.2: all-wrong and all-right groups go; the range is strict
    assert keep.tolist() == [False, True, False, True, True, True]
    assert expand_to_samples(keep, 2) == [2, 3, 6, 7, 8, 9, 10, 11]
    assert keep_groups(scores, 2, (0.3, 0.9)).tolist() == [False, True, False, True, True, False]
    with pytest.raises(ValueError):
        keep_groups(scores, 5, (0.0, 1.0))


def test_pass_at_k_by_hand():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 1.0]])
    assert pass_at_k(rewards) == pytest.approx({"pass@1": 4 / 12, "pass@4": 2 / 3})
    metrics = eval_metrics(rewards, ["a", "b", "a"], torch.tensor([3, 5, 7] * 4))
    assert metrics["eval/pass@1"] == pytest.approx(1 / 3) and metrics["eval/response_length"] == pytest.approx(5)
    assert metrics["eval/a/pass@4"] == pytest.approx(1.0) and metrics["eval/b/pass@1"] == 0.0
    assert "eval/a/pass@1" not in eval_metrics(rewards, ["a"] * 3, torch.ones(12))  # one source: no split


def _cfg(*flags):
    return parse_config(PPOConfig, ["--pretrain", "m", "--actor_num_gpus_per_node", "4", *flags], "t")


def test_colocation_pools():
    everything = {"actor", "reference", "critic", "reward", "engines"}
    assert colocation_pools(_cfg(), everything) == []
    hybrid, = colocation_pools(_cfg("--colocate_all_models"), everything)
    assert hybrid.bundles == 4 and hybrid.members == ("actor", "reference", "critic", "reward", "engines")
    assert hybrid.fraction == 0.2
    hybrid, = colocation_pools(_cfg("--colocate_all_models"), {"actor", "engines"})
    assert hybrid.fraction == 0.5
    pools = colocation_pools(_cfg("--colocate_actor_ref", "--colocate_critic_reward", "--critic_num_gpus_per_node",
                                  "2"), everything)
    assert [(p.name, p.bundles, p.members) for p in pools] == [("actor_ref", 4, ("actor", "reference")),
                                                               ("critic_reward", 2, ("critic", "reward"))]
    # a pool needs both members: no reference model -> no actor_ref pool
    assert colocation_pools(_cfg("--colocate_actor_ref"), {"actor", "engines"}) == []
