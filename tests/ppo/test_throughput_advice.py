"""Throughput arithmetic, the bottleneck advisor's rules and --profile_steps parsing, against hand-computed values."""

from __future__ import annotations

import pytest

from openppo.ppo.config import PPOConfig
from openppo.ppo.reporting import (
    RunHistory,
    advice_text,
    advise,
    attention_flops,
    idle_seconds,
    mfu,
    peak_flops,
    run_means,
    step_throughput,
    train_flops,
)
from openppo.utils.profiling import parse_profile_steps


def test_flops_and_mfu():
    assert train_flops(1_000_000, 1000) == 6e9  # 6 N per token
    assert train_flops(1_000_000, 1000, gradient_checkpointing=True) == 8e9  # the forward runs twice
    # the attention's own: 12 x layers x width x L a token of a sequence of L (PaLM's count), 16 checkpointed
    assert attention_flops(2, 64, [10, 20]) == 12 * 2 * 64 * (10 * 10 + 20 * 20)
    assert attention_flops(2, 64, [10, 20], gradient_checkpointing=True) == 16 * 2 * 64 * 500
    # the 0.5B shape at 4096-token rows: a third more than 6 x params
    share = attention_flops(24, 896, [4096]) / train_flops(526_860_544, 4096)
    assert share == pytest.approx(0.334, abs=0.001)
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989e12
    assert peak_flops("NVIDIA H200", "fp16") == 989e12
    assert peak_flops("NVIDIA H100 80GB HBM3", "fp32") is None and peak_flops("cpu", "bf16") is None
    # half the peak of one device for one second
    assert mfu(989e12 / 2, 1.0, 989e12) == pytest.approx(0.5)
    assert mfu(989e12, 1.0, 989e12, devices=4) == pytest.approx(0.25)
    assert mfu(1e12, 1.0, None) is None


def test_idle_is_the_step_outside_its_stages():
    assert idle_seconds({"timing/generate": 2.0, "timing/actor_train": 3.0}, 6.0) == pytest.approx(1.0)
    # async: generation and scoring ran beside the step; the step waited 0.5 s for them
    timing = {"timing/generate": 5.0, "timing/reward": 1.0, "timing/wait_rollout": 0.5, "timing/actor_train": 3.0}
    assert idle_seconds(timing, 4.0) == pytest.approx(0.5)
    assert idle_seconds({"timing/actor_train": 3.0}, 2.0) == 0.0


def test_step_throughput():
    out = step_throughput(
        generated_tokens=100,
        trained_tokens=300,
        samples=4,
        timing={"timing/generate": 2.0, "timing/actor_train": 3.0, "timing/step": 5.0},
    )
    assert out == pytest.approx(
        {
            "perf/generate_tokens_per_s": 50.0,
            "perf/train_tokens_per_s": 100.0,
            "perf/samples_per_s": 0.8,
            "perf/generated_tokens_per_hour": 72000.0,
        }
    )
    assert step_throughput(generated_tokens=1, trained_tokens=1, samples=1, timing={}) == {}


def _history(step_s: float | None = None, **seconds) -> RunHistory:
    """Three steps; the first (a warm-up, ignored) ten times slower. The step's wall time is the sum of the stages
    unless given."""
    step = {f"timing/{k}": v for k, v in seconds.items() if not k.startswith("perf_")}
    step.update({f"perf/{k[5:]}": v for k, v in seconds.items() if k.startswith("perf_")})
    step["timing/step"] = step_s or sum(v for k, v in step.items() if k.startswith("timing/"))
    return RunHistory.of([{k: 10 * v for k, v in step.items()}, dict(step), dict(step)])


def _rules(history, cfg=None, host=0.0) -> dict[str, str]:
    return {a.rule: str(a) for a in advise(history, cfg or PPOConfig(), host)}


def test_run_means_skip_the_warm_up_step():
    assert run_means(_history(generate=1.0, actor_train=1.0))["timing/step"] == 2.0


def test_balanced_run_fires_nothing():
    history = _history(
        generate=3.0,
        reward=0.5,
        old_logprob=1.0,
        actor_train=4.0,
        weight_sync=0.5,
        idle=0.5,
        perf_actor_padding_share=0.05,
    )
    assert advise(history, PPOConfig()) == []
    assert "no rule fired" in advice_text([])


def test_generation_bound():
    cfg = PPOConfig()
    cfg.rollout.n_samples_per_prompt = 4
    rules = _rules(_history(generate=6.0, actor_train=3.0, idle=1.0), cfg)
    assert list(rules) == ["generation-bound"]
    text = rules["generation-bound"]
    assert "60% of the step (6.00 s of 10.00 s)" in text
    for flag in ("--vllm_num_engines 2", "--enable_prefix_caching", "--async_train"):
        assert flag in text
    cfg.vllm.enable_prefix_caching = True  # a flag already used is not suggested again
    assert "--enable_prefix_caching" not in _rules(_history(generate=6.0, actor_train=4.0), cfg)["generation-bound"]


def test_async_run_is_generation_bound_when_it_waits():
    cfg = PPOConfig()
    cfg.rollout.async_train = True
    rules = _rules(_history(9.0, generate=9.0, wait_rollout=3.0, actor_train=5.0, idle=1.0), cfg)
    assert "waiting for generation takes 33%" in rules["generation-bound"]
    assert "--async_train" not in rules["generation-bound"].split("->")[1]


def test_training_bound_and_padding_heavy():
    rules = _rules(_history(generate=2.0, actor_train=7.0, idle=1.0, perf_actor_padding_share=0.35))
    assert "70% of the step" in rules["training-bound"] and "--packing_samples" in rules["training-bound"]
    assert "35% of the positions" in rules["padding-heavy"] and "--use_dynamic_batch" in rules["padding-heavy"]
    cfg = PPOConfig()
    cfg.rollout.packing_samples = cfg.rollout.use_dynamic_batch = True  # nothing left to suggest for padding
    assert "padding-heavy" not in _rules(_history(generate=2.0, actor_train=7.0, perf_actor_padding_share=0.35), cfg)


def test_reward_sync_swap_forward_and_idle_rules():
    rules = _rules(
        _history(
            generate=0.5,
            reward=3.0,
            old_logprob=2.5,
            ref_logprob=1.5,
            weight_sync=1.5,
            swap=2.5,
            actor_train=0.5,
            perf_weight_sync_buckets=8,
        )
    )
    assert set(rules) == {"reward-bound", "scoring-forwards", "weight-sync", "memory-swap"}
    assert "25% of the step" in rules["reward-bound"]
    assert "--micro_rollout_batch_size 16" in rules["scoring-forwards"]
    assert "--vllm_sync_bucket_mb 1024 (fewer, larger messages: 8 a sync now)" in rules["weight-sync"]
    assert "controller-idle" in _rules(_history(generate=1.0, actor_train=1.0, idle=1.0))


def test_larger_buckets_are_advised_only_for_a_sync_of_many():
    # SmolLM2's 257 MiB in 2 buckets of 256: a larger bucket saves one message, nothing to advise
    assert "weight-sync" not in _rules(
        _history(generate=3.0, actor_train=6.0, weight_sync=1.5, perf_weight_sync_buckets=2)
    )
    # a run that logged no bucket count: its megabytes over --vllm_sync_bucket_mb (1500 / 256 -> 6 buckets)
    rules = _rules(_history(generate=3.0, actor_train=6.0, weight_sync=1.5, perf_weight_sync_mb=1500.0))
    assert "(fewer, larger messages: 6 a sync now)" in rules["weight-sync"]
    cfg = PPOConfig()
    cfg.vllm.vllm_sync_backend = "gloo"  # few buckets, but a backend to change
    rules = _rules(_history(generate=3.0, actor_train=6.0, weight_sync=1.5, perf_weight_sync_buckets=2), cfg)
    assert "--vllm_sync_backend nccl" in rules["weight-sync"] and "--vllm_sync_bucket_mb" not in rules["weight-sync"]


def test_memory_bound_on_gpu_and_on_cpu():
    rules = _rules(_history(generate=3.0, actor_train=3.0, perf_actor_gpu_peak_gib=75.0, perf_actor_gpu_total_gib=80.0))
    assert "75.0 of 80.0 GiB (94%)" in rules["memory-bound"]
    assert "--gradient_checkpointing" in rules["memory-bound"] and "--zero_stage 3" in rules["memory-bound"]
    cpu = _history(generate=3.0, actor_train=3.0, perf_actor_rss_gib=20.0, perf_driver_rss_gib=2.5)
    assert "memory-bound" in _rules(cpu, host=24.0) and "memory-bound" not in _rules(cpu, host=64.0)
    # offloading to host memory helps a GPU run only: a CPU run's states are already there
    assert "--adam_offload" in rules["memory-bound"] and "--ref_reward_offload" in rules["memory-bound"]
    on_cpu = _rules(cpu, host=24.0)["memory-bound"]
    assert "--adam_offload" not in on_cpu and "--ref_reward_offload" not in on_cpu and "--zero_stage 3" in on_cpu


def test_profile_steps_parse():
    assert parse_profile_steps("5,2, 5") == [2, 5]
    assert parse_profile_steps(None) == []
    for bad in ("0", "a,b", "-1"):
        with pytest.raises(ValueError):
            parse_profile_steps(bad)
