"""--full_determinism: a run resumed at step 2 repeats the unbroken run's step 3, number for number.

Real Ray + DeepSpeed (ZeRO-2) + vLLM CPU, 1 actor rank, 1 engine, tiny fp32 model. Two runs: 3 steps unbroken,
saving every step, then, with the marker of step 3 removed, a resume from step 2 that runs step 3 again. The engines are reseeded from --seed and the prompt position at
every generation round, so step 3 draws the same samples after the resume as in the unbroken run; the trainer's
state is restored bitwise (tests/ppo/test_resume_state.py), and so is the adaptive KL coefficient (--kl_target),
which moves every step."""

from __future__ import annotations

import pytest

from openppo.strategy import checkpoint as ckpt
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
            "--actor_learning_rate", "1e-3", "--seed", "5", "--save_steps", "1", "--full_determinism",
            "--save_path", str(save), "--ckpt_path", str(ckpt_dir)]


def test_resumed_run_repeats_the_unbroken_one(tmp_path):
    # label "mixed": rewards 0.25/0.75 by response parity, so the policy moves and the samples matter
    prompts = write_jsonl([{**row, "label": "mixed"} for row in make_rows(16, seed=9)], tmp_path / "prompts.jsonl")
    ckpt_dir = tmp_path / "ckpt"
    run_cli("train_ppo_ray", _args(prompts, tmp_path / "whole", ckpt_dir, 3), nproc=1, timeout=600)
    ckpt.marker_path(ckpt_dir, 3).unlink()  # step 3 was never saved, as far as a resume can tell
    proc = run_cli("train_ppo_ray", _args(prompts, tmp_path / "resumed", ckpt_dir, 3) + ["--load_checkpoint"],
                   nproc=1, timeout=600)
    assert f"resumed from {ckpt_dir} at step 2" in proc.stdout + proc.stderr
    whole, resumed = read_metrics(tmp_path / "whole"), read_metrics(tmp_path / "resumed")
    assert [r["step"] for r in whole] == [1, 2, 3] and [r["step"] for r in resumed] == [3]
    assert {k: whole[2][k] for k in COMPARED} == {k: resumed[0][k] for k in COMPARED}, (whole[2], resumed[0])
    # the numbers compared move from step to step: the policy learns and the KL coefficient adapts
    assert whole[2]["rollout/logprob_diff"] < 1e-4 and whole[0]["policy_loss"] != whole[2]["policy_loss"]
    assert len({r["rollout/kl_coef"] for r in whole}) == 3
