"""Pure pieces of the RL controller: prompt order and resume position, DAPO group filter, pass@k, colocation."""

from __future__ import annotations

import pytest
import torch

from openppo.config.schema import parse_config
from openppo.ppo.collector import Collector, PromptStream, RolloutSource, eval_metrics, keep_groups, pass_at_k
from openppo.ppo.colocation import colocation_pools, device_demand
from openppo.ppo.config import PPOConfig
from openppo.rollout.pool import Sample


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
    assert keep_groups(scores, 2, (0.3, 0.9)).tolist() == [False, True, False, True, True, False]
    with pytest.raises(ValueError):
        keep_groups(scores, 5, (0.0, 1.0))


class _ParitySource(RolloutSource):
    """Scores each sample by its prompt's parity (odd prompts: all 1, so --dynamic_filtering drops them; even: 0 and
    1), and records the rounds. The engines' part is covered end to end in tests/ppo/test_train_ppo_ray.py."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.rounds: list[list[int]] = []
        self.seeds: list[int | None] = []

    def generate(self, items, *, n, temperature, seed, version):
        self.rounds.append([it["index"] for it in items])
        self.seeds.append(seed)
        return [
            Sample(
                prompt_ids=[1],
                response_ids=[2],
                rollout_log_probs=[0.0],
                finish_reason="stop",
                group=it["index"],
                label=None,
                prompt_text="",
                policy_version=version,
            )
            for it in items
            for _ in range(n)
        ]

    def score(self, samples):
        return torch.tensor([1.0 if s.group % 2 or i % 2 else 0.0 for i, s in enumerate(samples)]), {}


def _collector(*flags, prompts=24):
    cfg = _cfg("--n_samples_per_prompt", "2", "--rollout_batch_size", "4", "--async_train", *flags)
    stream = PromptStream(prompts, rollout_batch_size=4, num_episodes=1, seed=0)
    source = _ParitySource(cfg)
    return Collector(cfg, [{"index": i} for i in range(prompts)], source, source, stream, lambda: 0), source


def test_oversampling_keeps_the_surplus_groups_for_the_next_batch():
    # --vllm_generate_batch_size 6 with batches of 4: a round draws what is missing plus 2
    collector, source = _collector("--vllm_generate_batch_size", "6")
    first = collector.collect()
    assert [len(r) for r in source.rounds] == [6] and first.logs["rollout/groups_ahead"] == 2
    assert [s.group for s in first.samples][::2] == source.rounds[0][:4] and first.scores.numel() == 8
    ahead = source.rounds[0][4:]
    # a checkpoint of this batch resumes at the first group generated ahead
    assert first.stream_state["cursor"] == 4
    second = collector.collect()
    assert [len(r) for r in source.rounds] == [6, 4]  # 2 missing + 2 surplus
    assert [s.group for s in second.samples][::2] == ahead + source.rounds[1][:2]
    assert second.taken == source.rounds[1] and second.stream_state["cursor"] == 8
    # with dynamic filtering the odd prompts are dropped: only kept groups wait, and the round count shows
    collector, source = _collector("--vllm_generate_batch_size", "8", "--dynamic_filtering")
    batch = collector.collect()
    assert all(s.group % 2 == 0 for s in batch.samples) and len(batch.samples) == 8
    kept = [g for g in sum(source.rounds, []) if g % 2 == 0]
    assert batch.logs["rollout/groups_ahead"] == len(kept) - 4
    assert batch.logs["rollout/filtered_ratio"] == pytest.approx(1 - len(kept) / len(sum(source.rounds, [])))
    # without the flag no group waits and nothing is logged about it
    collector, source = _collector()
    assert "rollout/groups_ahead" not in collector.collect().logs and collector.ahead == []


def test_full_determinism_seeds_every_eval_round_alike():
    """--full_determinism: each eval round has a seed of its own, the same at every eval (an eval of the same weights
    draws the same samples; tests/ppo/test_molt_quick_start.py compares two), apart from the training rounds' seeds;
    without the flag the engines' own RNG draws (seed None)."""
    collector, source = _collector("--full_determinism")
    items = [{"index": i, "prompt_ids": [1]} for i in range(5)]
    collector.collect()
    for _ in range(2):
        collector.evaluate(items, 2, 1.0, batch_size=2)
    training, first, second = source.seeds[0], source.seeds[1:4], source.seeds[4:]
    assert first == second and len(set(first)) == 3 and training not in first, source.seeds
    assert [len(r) for r in source.rounds[1:4]] == [2, 2, 1]
    collector, source = _collector()
    collector.evaluate(items, 2, 1.0)
    assert source.seeds == [None]


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


def test_colocate_all_models_with_async_train_leaves_the_engines_devices_of_their_own():
    """OpenRLHF's rule: the DeepSpeed models share the actor's 4 devices, the 2 engines generate on 2 more."""
    everything = {"actor", "reference", "critic", "reward", "engines"}
    cfg = _cfg("--colocate_all_models", "--async_train", "--vllm_num_engines", "2")
    (pool,) = colocation_pools(cfg, everything)
    assert (pool.name, pool.bundles, pool.members, pool.fraction) == (
        "deepspeed",
        4,
        ("actor", "reference", "critic", "reward"),
        0.25,
    )
    assert colocation_pools(cfg, {"actor", "engines"}) == []  # the actor alone: nothing to share
    demand = device_demand(cfg, {"actor": 4, "reference": 4}, on_gpu=True)
    assert [(d.what, d.count, d.placement_group) for d in demand] == [
        ("actor + reference (deepspeed: --actor_num_nodes x --actor_num_gpus_per_node)", 4, True),
        ("vLLM engines (--vllm_num_engines x --vllm_tensor_parallel_size)", 2, False),
    ]
    hybrid = device_demand(_cfg("--colocate_all_models", "--vllm_num_engines", "4"), {"actor": 4}, on_gpu=True)
    assert [(d.count, d.placement_group) for d in hybrid] == [(4, True)]


def test_engine_placement_covers_every_hybrid_bundle_once():
    """Seed 004's hybrid engine: 8 actor ranks, 4 engines of TP 2. Worker w of engine i sits on actor rank 2i + w's
    device; on GPUs vLLM's Ray executor places the workers (the engine actor holds a sliver of its first bundle's
    GPU, so that Ray shows it that GPU only, and each worker the rest of its share), on CPU the engine's own processes
    run them."""
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
    assert all(p.executor == "ray" and p.num_gpus == 1e-4 and p.num_cpus == 0.5 for p in gpu)
    assert dict(gpu[3].env) == {"VLLM_RAY_BUNDLE_INDICES": "6,7", "VLLM_RAY_PER_WORKER_GPUS": "0.4999"}
    cpu = engine_placement(cfg, 1, on_gpu=False, hybrid_share=share)
    assert cpu.bundles == (2, 3) and cpu.executor is None and cpu.num_gpus == 0 and cpu.env == ()
    single = engine_placement(
        _cfg("--colocate_all_models", "--vllm_num_engines", "4"), 3, on_gpu=True, hybrid_share=0.5
    )
    assert single.bundles == (3,) and single.num_gpus == 0.5 and single.executor is None
    own = engine_placement(cfg, 0, on_gpu=True, hybrid_share=None)
    assert own.bundles is None and own.num_gpus == 2
