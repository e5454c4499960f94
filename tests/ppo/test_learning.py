"""The RL loop learns: on a tiny task with a learnable start, GRPO raises the reward within a few steps (real Ray,
DeepSpeed and vLLM CPU, 1 actor rank + 1 engine)."""

from __future__ import annotations

import json

import pytest

from tests.cli.helpers import REPO, read_metrics, run_cli, series
from tests.model_cache import favoured_word_model_dir

pytestmark = pytest.mark.slow


def test_grpo_reward_rises_on_target_word_task(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"input": f"Say world. ({i})", "label": "world"}) + "\n" for i in range(64)))
    save = tmp_path / "out"
    run_cli(
        "train_ppo_ray",
        [
            "--pretrain",
            str(favoured_word_model_dir()),
            "--remote_rm_url",
            str(REPO / "examples/reward_funcs/target_token.py"),
            "--prompt_data",
            str(prompts),
            "--input_key",
            "input",
            "--label_key",
            "label",
            "--apply_chat_template",
            "--advantage_estimator",
            "group_norm",
            "--n_samples_per_prompt",
            "8",
            "--rollout_batch_size",
            "4",
            "--train_batch_size",
            "32",
            "--micro_train_batch_size",
            "8",
            "--micro_rollout_batch_size",
            "16",
            "--vllm_kv_cache_bytes",
            str(128 * 2**20),
            "--init_kl_coef",
            "0",
            "--generate_max_len",
            "8",
            "--prompt_max_len",
            "64",
            "--param_dtype",
            "fp32",
            "--zero_stage",
            "0",
            "--max_steps",
            "10",
            "--actor_learning_rate",
            "5e-5",
            "--lr_warmup_ratio",
            "0",
            "--save_path",
            str(save),
            "--ckpt.disable_final_save",  # (Molt's spelling) nothing below reads the trained model
        ],
        nproc=1,
        timeout=800,
    )
    assert (save / "summary.txt").is_file() and not (save / "config.json").exists()  # records, no model
    rewards = [v for _, v in series(read_metrics(save), "train/reward")]
    assert len(rewards) == 10
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    # measured: 0.22 0.32 0.57 0.78 0.79 0.85 0.79 0.89 0.93 0.94
    assert last > first + 0.3, rewards
