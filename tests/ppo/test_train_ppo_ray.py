"""train_ppo_ray end to end on real Ray + DeepSpeed (2 actor ranks, ZeRO-3) + vLLM CPU (1 engine), tiny model."""

from __future__ import annotations

import json

import pytest

from openppo.tasks.arithmetic import make_rows, write_jsonl
from tests.cli.helpers import REPO, read_metrics, run_cli, series
from tests.model_cache import tiny_model_dir

pytestmark = pytest.mark.slow

STEP_METRICS = ["policy_loss", "kl", "reward", "clip_ratio", "response_length", "rollout/logprob_diff",
                "timing/generate", "timing/reward", "timing/old_logprob", "timing/actor_train", "timing/weight_sync"]


def test_grpo_with_py_reward(tmp_path):
    prompts = write_jsonl(make_rows(16, seed=1), tmp_path / "prompts.jsonl")
    save = tmp_path / "out"
    run_cli("train_ppo_ray", [
        "--pretrain", str(tiny_model_dir()), "--remote_rm_url", str(REPO / "examples/reward_funcs/arithmetic.py"),
        "--prompt_data", str(prompts), "--input_key", "input", "--label_key", "label", "--apply_chat_template",
        "--advantage_estimator", "group_norm", "--n_samples_per_prompt", "4", "--rollout_batch_size", "4",
        "--train_batch_size", "8", "--micro_train_batch_size", "2", "--micro_rollout_batch_size", "4",
        "--actor_num_gpus_per_node", "2", "--vllm_num_engines", "1", "--vllm_kv_cache_bytes", str(256 * 2**20),
        "--init_kl_coef", "0", "--generate_max_len", "16", "--prompt_max_len", "64", "--zero_stage", "3",
        "--param_dtype", "fp32", "--max_steps", "2", "--actor_learning_rate", "1e-4", "--save_path", str(save)],
        nproc=1, timeout=600)
    records = read_metrics(save)
    assert [r["step"] for r in records] == [1, 2]
    for key in STEP_METRICS:
        assert all(key in r for r in records), key
    # fp32 engine and trainer agree on the sampled tokens before and after a weight sync
    assert all(r["rollout/logprob_diff"] < 1e-4 for r in records), series(records, "rollout/logprob_diff")
    assert (save / "model.safetensors").is_file()
    assert json.loads((save / "run_info.json").read_text())["config"]["algo"]["advantage_estimator"] == "group_norm"
