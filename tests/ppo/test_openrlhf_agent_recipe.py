"""OpenRLHF's agent recipe (examples/scripts/train_reinforce_baseline_ray_agent_async.sh, OpenRLHF 0.11.0) on
train_ppo_ray, flag for flag in its dotted spelling, with paths and sizes changed to the tiny model on CPU. Real
Ray, DeepSpeed and vLLM.

The recipe: REINFORCE++-baseline with a k2 KL loss, icepop IS correction, dynamic filtering, packed rows in dynamic
batches, async training with partial rollouts, every model colocated with sleep, ZeRO-3, and its agent file
(`--train.agent_func_path`) written against OpenRLHF's agent interface: tests/agents/openrlhf_vowels_agent.py, a
two-turn `AgentInstance` bound by `AgentExecutor(MultiTurnAgentExecutor)` that imports `openrlhf.utils.agent` and
runs unchanged (openppo/agents/openrlhf_agent.py).
"""

from __future__ import annotations

import json

import pytest

from tests.cli.helpers import REPO, read_metrics, run_cli
from tests.model_cache import tiny_model_dir

pytestmark = pytest.mark.slow

AGENT = REPO / "tests/agents/openrlhf_vowels_agent.py"


def recipe_args(model, data, save) -> list[str]:
    """The script's flags in its order; a comment gives the script's value where this one differs."""
    return [
        *("--actor.model_name_or_path", str(model)),
        "--ckpt.load_enable",
        *("--ckpt.output_dir", str(save)),
        *("--ckpt.path", f"{save}/ckpt"),
        "--ckpt.save_hf",
        *("--ckpt.max_num", "3"),
        *("--ckpt.save_steps", "10"),
        *("--train.agent_func_path", str(AGENT)),  # examples/python/agent_func.py
        *("--data.prompt_dataset", str(data)),
        *("--data.input_key", "prompt"),
        *("--data.label_key", "label"),
        *("--data.max_len", "128"),  # 74240
        *("--rollout.max_new_tokens", "16"),  # 64000
        "--data.apply_chat_template",
        "--ds.packing_samples",
        *("--rollout.batch_size", "2"),  # 128
        *("--rollout.n_samples_per_prompt", "4"),  # 8
        *("--train.batch_size", "8"),  # 1024
        "--algo.dynamic_filtering_enable",
        *("--algo.dynamic_filtering_range", "0.0", "1.0"),
        "--train.dynamic_batch_enable",
        *("--train.max_tokens_per_gpu", "256"),  # 16192
        *("--rollout.max_tokens_per_gpu", "512"),  # 32768
        *("--train.micro_batch_size", "1"),
        *("--rollout.micro_batch_size", "8"),
        *("--data.max_samples", "128000"),
        *("--train.max_epochs", "1"),
        *("--train.num_episodes", "1"),
        "--train.async_enable",
        "--train.partial_rollout_enable",
        *("--ref.num_nodes", "1"),
        *("--ref.num_gpus_per_node", "1"),  # 4
        *("--actor.num_nodes", "1"),
        *("--actor.num_gpus_per_node", "1"),  # 4
        *("--vllm.num_engines", "1"),  # 2
        *("--vllm.tensor_parallel_size", "1"),  # 2
        *("--vllm.gpu_memory_utilization", "0.95"),
        "--train.colocate_all",
        "--ds.enable_sleep",
        *("--vllm.sync_backend", "nccl"),
        "--vllm.enforce_eager",
        *("--ds.zero_stage", "3"),
        "--actor.gradient_checkpointing_enable",
        *("--ds.ring_attn_size", "1"),  # 2 (ring attention has its own tests: one actor rank here)
        *("--ds.ring_attn_head_stride", "1"),  # 2
        *("--ds.param_dtype", "fp32"),  # bf16: up to 58x slower on a CPU without AVX512_BF16 (docs/platform.md)
        *("--algo.advantage.estimator", "reinforce_baseline"),
        *("--actor.adam.lr", "5e-7"),
        *("--actor.entropy_coef", "0.0"),
        *("--algo.kl.init_coef", "1e-5"),
        "--algo.kl.use_loss",
        *("--algo.kl.estimator", "k2"),
        "--algo.advantage.is_correction_enable",
        *("--algo.advantage.is_correction_type", "icepop"),
        *("--logger.tensorboard_dir", f"{save}/runs"),
        *("--logger.logging_steps", "1"),
        *("--eval.steps", "-1"),
    ]


def test_openrlhfs_agent_recipe_runs_its_agent_file_unchanged(tmp_path):
    data = tmp_path / "prompts.jsonl"
    with open(data, "w") as f:
        for i in range(4):  # 2 steps of 2 prompts
            f.write(json.dumps({"prompt": f"What is {i} plus {i + 1}? Say it with vowels.", "label": str(2 * i + 1)}))
            f.write("\n")
    save = tmp_path / "run"
    proc = run_cli("train_ppo_ray", recipe_args(tiny_model_dir(), data, save), nproc=1)
    log = proc.stdout + proc.stderr
    records = read_metrics(save)
    assert [r["step"] for r in records] == [1, 2], log[-3000:]
    assert "openrlhf_vowels_agent.py: OpenRLHFAgentInstance, at most 4 model turns an episode" in log
    # --train.colocate_all with --train.async_enable, as OpenRLHF runs them: the DeepSpeed models share the actor's
    # devices, the engine generates on a device of its own and gets the weights by broadcast
    assert "--colocate_all_models with --async_train colocates the DeepSpeed models only (as OpenRLHF does)" in log
    assert "colocated (deepspeed): actor, reference share 1 device(s), 0.5 of each" in log
    assert "weight sync: engine(s) 0 via gloo broadcast" in log, log[-3000:]
    for r in records:
        # the OpenRLHF file played two turns per episode; its rewards (vowel shares) summed, its extra_logs and
        # scores logged
        assert r["rollout/agent_turns"] == 2.0 and 0 < r["env/vowel_share"] < 1 and "env/score" in r, r
        assert 0 < r["train/reward"] < 2 and r["rollout/filtered_ratio"] == 0.0, r  # every group's rewards differ
        assert {"train/kl_loss", "rollout/logprob_diff"} <= set(r), r
    # the first batch fresh and exact on every trained token (the feedback masked out)
    assert records[0]["rollout/staleness_max"] == 0 and records[0]["rollout/logprob_diff_max"] < 1e-4, records[0]
    assert (save / "model.safetensors").is_file()
