"""Molt's RL quick-start (examples/scripts/quick_start/rl_qwen3_4b.sh, Molt 0.1.6) on train_ppo_ray, flag for flag in
Molt's spelling, with paths and sizes changed to a tiny Qwen3 on CPU (issue 36). Real Ray, DeepSpeed and vLLM.

The recipe: REINFORCE++-baseline, the geometric-mean IS correction, dual clip, a k2 KL loss against a reference
colocated with the actor, dynamic filtering, packed rows, full gradient checkpointing, an eval set, checkpoints, and
its agent file (`--train.agent_path`) written against Molt's agent interface: tests/agents/molt_vowels_agent.py, a
two-turn environment that imports `molt.agents` and runs unchanged (openppo/agents/molt.py). Three steps, dumping
their rollout batches; then the recipe again replaying them (Molt's train-only replay, the same steps), and with
--eval.eval_only on the model it exported (the engine alone) and on its last checkpoint (the groups too).
"""

from __future__ import annotations

import json

import pytest

from tests.cli.helpers import REPO, read_metrics, run_cli
from tests.model_cache import tiny_model_dir

pytestmark = pytest.mark.slow

AGENT = REPO / "tests/agents/molt_vowels_agent.py"
CHAT_AGENT = REPO / "tests/agents/molt_chat_agent.py"


def quick_start_args(model, data, eval_data, save) -> list[str]:
    """The script's flags in its order; a comment gives the script's value where this one differs."""
    return [
        *("--actor.model_name_or_path", str(model)),
        *("--data.prompt_dataset", str(data)),
        *("--data.input_key", "prompt"),
        *("--data.label_key", "reward_model"),
        "--data.apply_chat_template",
        *("--data.max_samples", "4800"),
        *("--data.max_len", "96"),  # 16384
        *("--rollout.batch_size", "2"),  # 16
        *("--rollout.vllm_generate_batch_size", "1"),  # 8
        *("--rollout.micro_batch_size", "1"),
        *("--rollout.n_samples_per_prompt", "4"),  # 8
        *("--rollout.temperature", "1.0"),
        *("--rollout.max_new_tokens", "16"),  # (not in the script: Molt's default fills --data.max_len)
        *("--train.batch_size", "8"),  # 128
        *("--train.micro_batch_size", "1"),
        *("--train.max_epochs", "1"),
        *("--train.num_episodes", "1"),
        *("--train.async_queue_size", "2"),
        "--train.colocate_fsdp_models",
        *("--actor.num_nodes", "1"),
        *("--actor.num_gpus_per_node", "1"),  # 4
        *("--ref.num_nodes", "1"),
        *("--ref.num_gpus_per_node", "1"),  # 4
        *("--vllm.num_engines", "1"),
        *("--vllm.tensor_parallel_size", "1"),  # 4
        *("--vllm.sync_backend", "nccl"),
        *("--vllm.gpu_memory_utilization", "0.8"),
        *("--vllm.distributed_executor_backend", "mp"),
        *("--fsdp.param_dtype", "fp32"),  # bf16: up to 58x slower on a CPU without AVX512_BF16 (docs/platform.md)
        *("--fsdp.attn_implementation", "flash_attention_2"),
        *("--fsdp.tp_size", "1"),
        *("--fsdp.ep_size", "1"),
        *("--fsdp.cp_size", "1"),
        "--fsdp.packing_samples",
        *("--actor.gradient_checkpoint", "full"),
        *("--actor.adam.lr", "1e-6"),
        *("--actor.eps_clip_low_high", "0.2", "0.27"),
        *("--actor.dual_clip", "10.0"),
        *("--algo.advantage.estimator", "reinforce_baseline"),
        *("--algo.advantage.is_correction_level", "geo"),
        *("--algo.advantage.is_correction_threshold", "0.99", "1.01"),
        "--algo.kl.use_loss",
        *("--algo.kl.estimator", "k2"),
        *("--algo.kl.init_coef", "0.001"),
        "--algo.dynamic_filtering_enable",
        *("--algo.dynamic_filtering_range", "0.01", "0.99"),
        *("--reward.clip_range", "-10", "10"),
        *("--train.agent_path", str(AGENT)),  # examples/python/agents/math.py
        *("--eval.dataset", str(eval_data)),
        *("--eval.steps", "2"),  # 5: this run has three steps
        *("--eval.n_samples_per_prompt", "1"),
        *("--ckpt.output_dir", f"{save}/hf"),
        *("--ckpt.path", f"{save}/state"),
        *("--ckpt.save_steps", "2"),  # 5
        *("--logger.logging_steps", "1"),
        *("--logger.wandb.project", "molt_quickstart_qwen3_4b"),
        *("--logger.wandb.run_name", "qwen3_4b_quickstart"),
    ]


def write_rows(path, n: int, offset: int = 0):
    """Rows shaped like Molt's proRL math split: chat messages under `prompt`, the grader's dict under
    `reward_model`."""
    with open(path, "w") as f:
        for i in range(offset, offset + n):
            row = {
                "prompt": [{"role": "user", "content": f"What is {i} plus {i + 1}? Say it with vowels."}],
                "reward_model": {"ground_truth": str(2 * i + 1), "style": "rule"},
            }
            f.write(json.dumps(row) + "\n")
    return path


def test_molts_rl_quick_start_runs_three_steps(tmp_path):
    data = write_rows(tmp_path / "train.jsonl", 6)  # 3 steps of 2 prompts
    eval_data = write_rows(tmp_path / "eval.jsonl", 2, offset=100)
    save = tmp_path / "run"
    model, dump = tiny_model_dir(arch="qwen3"), tmp_path / "rollouts"
    argv = quick_start_args(model, data, eval_data, save) + ["--train.rollout_dump_dir", str(dump)]
    proc = run_cli("train_ppo_ray", argv, nproc=1)
    log = proc.stdout + proc.stderr
    records = read_metrics(save / "hf")
    assert [r["step"] for r in records] == [1, 2, 3]
    # as in Molt, batches are generated ahead: the first fresh and exact, later ones stale
    assert "a Molt recipe (--actor.gradient_checkpoint): batches are generated ahead of training" in log
    assert records[0]["rollout/staleness_max"] == 0 and records[0]["rollout/logprob_diff_max"] < 1e-4, records[0]
    # (up to --train.async_queue_size 2 syncs stale)
    staleness = [r["rollout/staleness_max"] for r in records[1:]]
    assert max(staleness) >= 1 and all(s <= 2 for s in staleness), staleness
    # the Molt agent file played two turns per episode; its rewards (vowel shares) summed, its info logged
    for r in records:
        assert r["rollout/agent_turns"] == 2.0 and 0 < r["env/vowel_share"] < 1, r
        assert 0 < r["train/reward"] < 2 and r["rollout/filtered_ratio"] == 0.0, r  # every group's rewards differ
        # the recipe's loss: dual clip, geo-mask IS correction, k2 KL loss at 0.001
        assert {"train/dual_clip_ratio", "train/is_masked_ratio", "train/kl_loss"} <= set(r) and r[
            "train/kl_coef"
        ] == 0.001
    assert records[2]["train/kl_loss"] > 0, records[2]
    # --eval.steps 2: evaluated once, at step 2; --ckpt.save_steps 2: resumable states at steps 2 and 3 (final)
    assert [("eval/pass@1" in r) for r in records] == [False, True, False]
    assert sorted(p.name for p in (save / "state" / "actor").glob("global_step*")) == ["global_step2", "global_step3"]
    assert (save / "hf" / "model.safetensors").is_file()
    # the recipe's CUDA-only settings, each said in one line
    assert "--attn_implementation flash_attention_2 needs CUDA devices: sdpa instead" in log
    assert "shared prompts (--share_prompt_in_group): on" in log  # (the kernel decided before the plan)
    assert "--rollout.vllm_generate_batch_size 1 has no effect: Molt's cap on the prompts in flight" in log

    # the same recipe replaying the batches it dumped (Molt's train-only replay): nothing generated, every step's
    # training the same as the run's (from the same start and seed)
    assert sorted(p.name for p in dump.iterdir()) == [f"rollout_step{n}.pt" for n in (1, 2, 3)]
    replayed = tmp_path / "replayed"
    argv = quick_start_args(model, data, eval_data, replayed) + ["--train.rollout_replay_dir", str(dump)]
    log = (lambda p: p.stdout + p.stderr)(run_cli("train_ppo_ray", argv, nproc=1))
    again = read_metrics(replayed / "hf")
    assert [r["step"] for r in again] == [1, 2, 3] and "timing/generate" not in again[0]
    same = ["train/policy_loss", "train/kl_loss", "train/entropy", "train/advantage_abs", "train/reward"]
    same += ["rollout/logprob_diff", "rollout/staleness_max", "env/vowel_share"]
    for r, original in zip(again, records):
        assert {k: r[k] for k in same} == pytest.approx({k: original[k] for k in same}, rel=1e-5, abs=1e-9), r
    assert f"--rollout_replay_dir: step 3 trains on the 8 samples of {dump / 'rollout_step3.pt'}" in log

    # then the same recipe with --eval.eval_only on what it exported: evaluated at step 0; nothing trained, saved or
    # exported, only the metrics written
    out = tmp_path / "evaluated"
    seeded = ["--eval.eval_only", "--train.full_determinism_enable"]  # (the evals' sampling seeded: comparable)
    argv = quick_start_args(save / "hf", data, eval_data, out) + seeded
    proc = run_cli("train_ppo_ray", argv, nproc=1)
    (evaluated,) = read_metrics(out / "hf")
    assert evaluated["step"] == 0 and 0 < evaluated["eval/pass@1"] < 2, evaluated
    assert not [k for k in evaluated if k.startswith(("train/", "rollout/"))], evaluated
    assert sorted(p.name for p in out.rglob("*") if p.is_file()) == ["metrics.jsonl", "rollouts.jsonl", "run_info.json"]
    assert (out / "hf" / "rollouts.jsonl").stat().st_size == 0
    log = proc.stdout + proc.stderr
    assert "--eval_only: evaluated" in log
    # of a model folder, only the engine starts (no actor or reference ranks: nothing to sync from)
    assert "only the engines and a reward model start" in log and "vLLM engine 0: pid" in log
    assert "actor ranks:" not in log and "reference ranks:" not in log, log[-3000:]

    # and of the run's last checkpoint (--ckpt.load_enable): the groups start, the actor loads step 3 and syncs the
    # engine, which evaluates it at step 3; nothing trained or saved. The exported folder holds the same weights, so
    # with the same seeds both evals draw the same samples
    resumed = tmp_path / "resumed"
    argv = quick_start_args(model, data, eval_data, resumed) + seeded + ["--ckpt.load_enable"]
    argv[argv.index("--ckpt.path") + 1] = str(save / "state")
    log = (lambda p: p.stdout + p.stderr)(run_cli("train_ppo_ray", argv, nproc=1))
    (again,) = read_metrics(resumed / "hf")
    assert "actor ranks:" in log and "at step 3 (prompt" in log and "engines re-synced" in log, log[-3000:]
    assert again["step"] == 3, again
    assert not [k for k in again if k.startswith(("train/", "rollout/"))], again
    assert sorted(p.name for p in resumed.rglob("*") if p.is_file()) == [
        "metrics.jsonl",
        "rollouts.jsonl",
        "run_info.json",
    ]
    evals = [k for k in evaluated if k.startswith("eval/")]
    assert {k: again[k] for k in evals} == {k: evaluated[k] for k in evals}, (again, evaluated)


def test_molts_rl_quick_start_runs_a_chat_agent(tmp_path):
    """The recipe with a Molt ChatAgentRunner file as --train.agent_path: openppo plays it through the run's
    OpenAI-compatible endpoint (the agent calls the policy itself) and trains on what the endpoint recorded."""
    data = write_rows(tmp_path / "train.jsonl", 6)
    eval_data = write_rows(tmp_path / "eval.jsonl", 2, offset=100)
    save = tmp_path / "run"
    argv = quick_start_args(tiny_model_dir(arch="qwen3"), data, eval_data, save)
    argv[argv.index("--train.agent_path") + 1] = str(CHAT_AGENT)
    log = (lambda p: p.stdout + p.stderr)(run_cli("train_ppo_ray", argv, nproc=1))
    assert "molt_chat_agent.py: a Molt ChatAgent, played through the run's endpoint" in log
    assert "agent endpoint serving" in log
    records = read_metrics(save / "hf")
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:  # the agent's rewards: vowel shares of its answers
        assert 0 < r["train/reward"] < 1 and "rollout/agent_turns" not in r, r
        assert r["rollout/agent_calls"] == 1.0 and r["env/chars"] > 0, r  # one call each; its info logged
