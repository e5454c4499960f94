"""Pure pieces of the RL controller: prompt order and resume position, DAPO group filter, pass@k, colocation."""

from __future__ import annotations

import pytest
import torch

from openppo.config.schema import parse_config
from openppo.ppo.collector import PromptStream, eval_metrics, expand_to_samples, keep_groups, pass_at_k
from openppo.ppo.colocation import colocation_pools
from openppo.ppo.config import PPOConfig


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
    (hybrid,) = colocation_pools(_cfg("--colocate_all_models"), everything)
    assert hybrid.bundles == 4 and hybrid.members == ("actor", "reference", "critic", "reward", "engines")
    assert hybrid.fraction == 0.2
    (hybrid,) = colocation_pools(_cfg("--colocate_all_models"), {"actor", "engines"})
    assert hybrid.fraction == 0.5
    pools = colocation_pools(
        _cfg("--colocate_actor_ref", "--colocate_critic_reward", "--critic_num_gpus_per_node", "2"), everything
    )
    assert [(p.name, p.bundles, p.members) for p in pools] == [
        ("actor_ref", 4, ("actor", "reference")),
        ("critic_reward", 2, ("critic", "reward")),
    ]
    # a pool needs both members: no reference model -> no actor_ref pool
    assert colocation_pools(_cfg("--colocate_actor_ref"), {"actor", "engines"}) == []


def test_engine_placement_covers_every_hybrid_bundle_once():
    """Seed 004's hybrid engine: 8 actor ranks, 4 engines of TP 2. Worker w of engine i sits on actor rank 2i + w's
    device; on GPUs vLLM's Ray executor places the workers (the engine actor holds no GPU), on CPU the engine's own
    processes run them."""
    from openppo.ppo.colocation import engine_placement

    cfg = parse_config(
        PPOConfig,
        [
            "--pretrain",
            "m",
            "--actor_num_gpus_per_node",
            "8",
            "--colocate_all_models",
            "--vllm_num_engines",
            "4",
            "--vllm_tensor_parallel_size",
            "2",
        ],
        "t",
    )
    share = colocation_pools(cfg, {"actor", "engines"})[0].fraction
    gpu = [engine_placement(cfg, i, on_gpu=True, hybrid_share=share) for i in range(4)]
    assert [p.bundles for p in gpu] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert all(p.executor == "ray" and p.num_gpus == 0 and p.num_cpus == 0.5 for p in gpu)
    assert dict(gpu[3].env) == {"VLLM_RAY_BUNDLE_INDICES": "6,7", "VLLM_RAY_PER_WORKER_GPUS": "0.5"}
    cpu = engine_placement(cfg, 1, on_gpu=False, hybrid_share=share)
    assert cpu.bundles == (2, 3) and cpu.executor is None and cpu.num_gpus == 0 and cpu.env == ()
    single = engine_placement(
        _cfg("--colocate_all_models", "--vllm_num_engines", "4"), 3, on_gpu=True, hybrid_share=0.5
    )
    assert single.bundles == (3,) and single.num_gpus == 0.5 and single.executor is None
    own = engine_placement(cfg, 0, on_gpu=True, hybrid_share=None)
    assert own.bundles is None and own.num_gpus == 2
