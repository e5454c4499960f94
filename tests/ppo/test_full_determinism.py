"""--full_determinism: a run resumed at step 2 repeats the unbroken run's steps, number for number.

Real Ray + DeepSpeed (ZeRO-2) + vLLM CPU, 1 actor rank, 1 engine, tiny fp32 model. Three runs: 3 steps unbroken,
2 steps saved, and a resume of those to step 3 (a constant LR: the schedule's length is --max_steps). The engines are reseeded from --seed and the prompt position at
every generation round, so step 3 draws the same samples after the resume as in the unbroken run; the trainer's
state is restored bitwise (tests/ppo/test_resume_state.py), and so is the adaptive KL coefficient (--kl_target),
which moves every step."""

from __future__ import annotations

import pytest

from openppo.tasks.arithmetic import make_rows, write_jsonl
from tests.cli.helpers import read_metrics, run_cli
from tests.model_cache import tiny_model_dir
from tests.ppo.test_crash_resume import HERE

pytestmark = pytest.mark.slow
# Everything a step computes from its samples and weights; timings, memory and throughput are left out.
COMPARED = ("reward", "policy_loss", "entropy", "clip_ratio", "response_length", "rollout/logprob_diff",
            "rollout/advantage_abs", "rollout/truncated_ratio", "policy/approx_kl", "kl", "rollout/kl_coef")


def _args(prompts, save, ckpt_dir, steps: int) -> list[str]:
    return ["--pretrain", str(tiny_model_dir()), "--remote_rm_url", str(HERE / "label_reward.py"),
            "--prompt_data", str(prompts), "--input_key", "input", "--label_key", "label", "--apply_chat_template",
            "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "2", "--rollout_batch_size", "2",
            "--train_batch_size", "2", "--micro_train_batch_size", "2", "--max_epochs", "2",
            "--vllm_kv_cache_bytes", str(128 * 2**20), "--init_kl_coef", "0.01", "--kl_target", "0.5",
            "--kl_horizon", "10", "--generate_max_len", "8",
            "--prompt_max_len", "64", "--param_dtype", "fp32", "--zero_stage", "2", "--max_steps", str(steps),
            "--actor_learning_rate", "1e-3", "--lr_scheduler", "constant", "--lr_warmup_ratio", "0", "--seed", "5", "--save_steps", "1", "--full_determinism",
            "--save_path", str(save), "--ckpt_path", str(ckpt_dir)]


def test_resumed_run_repeats_the_unbroken_one(tmp_path):
    # label "mixed": rewards 0.25/0.75 by response parity, so the policy moves and the samples matter
    prompts = write_jsonl([{**row, "label": "mixed"} for row in make_rows(16, seed=9)], tmp_path / "prompts.jsonl")
    run_cli("train_ppo_ray", _args(prompts, tmp_path / "whole", tmp_path / "whole_ckpt", 3), nproc=1, timeout=600)
    run_cli("train_ppo_ray", _args(prompts, tmp_path / "cut", tmp_path / "cut_ckpt", 2), nproc=1, timeout=600)
    proc = run_cli("train_ppo_ray", _args(prompts, tmp_path / "cut", tmp_path / "cut_ckpt", 3) + ["--load_checkpoint"],
                   nproc=1, timeout=600)
    assert "resumed from" in proc.stdout + proc.stderr
    whole, cut = read_metrics(tmp_path / "whole"), read_metrics(tmp_path / "cut")
    assert [r["step"] for r in whole] == [r["step"] for r in cut] == [1, 2, 3]
    for a, b in zip(whole, cut):
        assert {k: a[k] for k in COMPARED} == {k: b[k] for k in COMPARED}, (a["step"], a, b)
    # the run learned something (the comparison is of moving numbers)
    assert whole[2]["rollout/logprob_diff"] < 1e-4 and whole[0]["policy_loss"] != whole[2]["policy_loss"]
    assert len({r["rollout/kl_coef"] for r in whole}) == 3
