"""GRPO on image prompts end to end (real Ray, DeepSpeed on 2 actor ranks, a vLLM CPU engine, the tiny Idefics3 VLM
in fp32): the built-in shapes task's pictures reach the engine, the actor and the reference; the engine's and the
trainer's log-probs agree; the reward function sees each prompt's count; the synced engine computes with the
trainer's weights. Two runs: ZeRO-2 with the vision tower frozen (it does not move, every language-model tensor
does), flags in OpenRLHF >= 0.10's dotted names; ZeRO-3 with LoRA on the language model (the adapters sit in the
decoder only, merged into the engine's weights), flags in the flat names. Then an agent over the same prompts: an
OpenRLHF agent file's two turns with feedback between them that shows a picture of its own."""

from __future__ import annotations

import pytest
import torch

from openppo.tasks.arithmetic import write_jsonl
from openppo.tasks.shapes import make_rows
from tests.cli.helpers import REPO, read_metrics, run_cli, series
from tests.model_cache import tiny_vlm_dir

pytestmark = pytest.mark.slow

SYNC_CHECKED = "--vllm_sync_check: 1 engine(s) compute with the trainer's weights: "


FROZEN_TOWER = ["--data.image_key", "images", "--data.max_images_per_prompt", "1", "--actor.freeze_visual_encoder"]
FROZEN_TOWER += ["--zero_stage", "2"]
LORA = ["--image_key", "images", "--max_images_per_prompt", "1", "--lora_rank", "4", "--lora_alpha", "8"]
LORA += ["--target_modules", "all-linear", "--zero_stage", "3"]


@pytest.mark.parametrize("variant", [FROZEN_TOWER, LORA], ids=["zero2-frozen-tower-dotted", "zero3-lora-flat"])
def test_grpo_on_image_prompts(tmp_path, variant):
    from safetensors.torch import load_file

    model = tiny_vlm_dir()
    prompts = write_jsonl(make_rows(8, seed=2), tmp_path / "shapes.jsonl")
    save = tmp_path / "out"
    proc = run_cli(
        "train_ppo_ray",
        [
            "--pretrain",
            str(model),
            "--prompt_data",
            str(prompts),
            "--input_key",
            "prompt",
            "--label_key",
            "label",
            *variant,
            "--apply_chat_template",
            "--remote_rm_url",
            str(REPO / "tests/ppo/shapes_reward.py"),
            "--advantage_estimator",
            "group_norm",
            "--n_samples_per_prompt",
            "4",
            "--rollout_batch_size",
            "4",
            "--train_batch_size",
            "8",
            "--micro_train_batch_size",
            "2",
            "--micro_rollout_batch_size",
            "4",
            "--actor_num_gpus_per_node",
            "2",
            "--vllm_num_engines",
            "1",
            "--param_dtype",
            "fp32",
            "--init_kl_coef",
            "0.01",
            "--use_kl_loss",
            "--generate_max_len",
            "8",
            "--prompt_max_len",
            "64",
            "--max_steps",
            "2",
            "--actor_learning_rate",
            "1e-3",
            "--lr_warmup_ratio",
            "0",
            "--vllm_sync_check",
            "--save_path",
            str(save),
        ],
        nproc=1,
        timeout=600,
    )
    assert proc.stdout.count(SYNC_CHECKED) == 1, proc.stdout[-3000:]
    records = read_metrics(save)
    assert [r["step"] for r in records] == [1, 2]
    print("logprob_diff_max per step:", series(records, "rollout/logprob_diff_max"))
    # the images reached both sides: the trainer scores what the engine sampled, image tokens and all
    assert all(r["rollout/logprob_diff"] < 1e-4 for r in records), series(records, "rollout/logprob_diff")
    assert all(1.0 <= r["reward/label"] <= 4.0 for r in records), series(records, "reward/label")
    assert all(r["train/advantage_abs"] > 0.1 for r in records), series(records, "train/advantage_abs")
    before = load_file(model / "model.safetensors")
    if variant is LORA:
        adapter = load_file(save / "adapter_model.safetensors")
        assert adapter and all(".text_model." in k and "lora_" in k for k in adapter), sorted(adapter)[:4]
        return
    after = load_file(save / "model.safetensors")
    assert before.keys() == after.keys()
    tower = {k for k in before if ".vision_model." in k or ".connector." in k}
    assert f"weight sync: {len(before) - len(tower)} tensors" in proc.stdout  # the frozen tower is not sent
    assert tower and all(torch.equal(before[k], after[k]) for k in tower)
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert moved == set(before) - tower


def test_an_agent_over_image_prompts(tmp_path):
    """--agent_func_path with image prompts (an OpenRLHF agent file, tests/agents/openrlhf_shapes_agent.py, whose
    feedback shows a picture of its own): every turn goes to the engine with the episode's images, the rows the
    trainer scores hold the expanded prompt, both turns and the feedback between them with its picture expanded
    (masked out), and the engine's and trainer's log-probs agree on every turn."""
    model = tiny_vlm_dir()
    prompts = write_jsonl(make_rows(8, seed=3), tmp_path / "shapes.jsonl")
    save = tmp_path / "out"
    flags = ["--pretrain", str(model), "--prompt_data", str(prompts), "--input_key", "prompt", "--label_key", "label"]
    flags += ["--image_key", "images", "--max_images_per_prompt", "2", "--apply_chat_template", "--zero_stage", "2"]
    flags += ["--agent_func_path", str(REPO / "tests/agents/openrlhf_shapes_agent.py"), "--agent_max_turns", "3"]
    flags += ["--advantage_estimator", "group_norm", "--n_samples_per_prompt", "4", "--rollout_batch_size", "4"]
    flags += ["--train_batch_size", "16", "--micro_train_batch_size", "4", "--micro_rollout_batch_size", "4"]
    flags += ["--vllm_num_engines", "1", "--param_dtype", "fp32", "--generate_max_len", "6", "--prompt_max_len", "128"]
    flags += ["--max_steps", "1", "--actor_learning_rate", "1e-3", "--save_path", str(save)]
    run_cli("train_ppo_ray", flags, nproc=1, timeout=600)
    (record,) = read_metrics(save)
    print({k: record[k] for k in ("rollout/logprob_diff_max", "train/response_length", "train/advantage_abs")})
    # two turns per episode (the environment ends it after the second), the feedback between them
    assert record["rollout/agent_turns"] == 2.0 and record["env/counted"] == 1.0, record
    # two turns of up to 6 tokens and the feedback: its text and its picture's tokens (6 in the tiny Idefics3)
    assert record["train/response_length"] > 6 + 6, record
    # the images reached both sides on every turn: the trainer scores what the engine sampled, image tokens and all
    assert record["rollout/logprob_diff_max"] < 1e-4, record
    assert record["train/advantage_abs"] > 0.1, record


def test_openrlhfs_vlm_recipe_runs_as_written(tmp_path):
    """OpenRLHF 0.11.0's VLM recipe (train_vlm_math_hybrid_engine.sh, its command line in
    tests/assets/openrlhf_flags/recipes.json) with its paths and sizes changed and nothing else: the hybrid engine
    (--train.colocate_all: the actor, and the engine on its device, sleeping in turns), ZeRO-3, the frozen vision
    tower, REINFORCE++-baseline with --algo.kl.use_loss at --algo.kl.init_coef 0 (no reference), on the shapes task
    with the tiny Idefics3."""
    import json

    recipe = json.loads((REPO / "tests/assets/openrlhf_flags/recipes.json").read_text())
    args = recipe["v0.11.0"]["train_vlm_math_hybrid_engine.sh"]["args"]
    save = tmp_path / "out"
    changed = {
        "--ref.num_gpus_per_node": "1",
        "--actor.num_gpus_per_node": "1",
        "--vllm.num_engines": "1",
        "--actor.model_name_or_path": str(tiny_vlm_dir()),
        "--reward.remote_url": str(REPO / "tests/ppo/shapes_reward.py"),  # examples/python/math_reward_func.py
        "--ckpt.output_dir": str(save),
        "--ckpt.path": str(save / "ckpt"),
        "--train.batch_size": "8",
        "--rollout.batch_size": "2",
        "--rollout.n_samples_per_prompt": "4",
        "--train.num_episodes": "1",
        "--data.max_len": "128",
        "--rollout.max_new_tokens": "8",
        "--ds.param_dtype": "fp32",  # bf16: up to 58x slower on a CPU without AVX512_BF16 (docs/platform.md)
        "--data.prompt_dataset": str(write_jsonl(make_rows(4, seed=4), tmp_path / "shapes.jsonl")),
    }
    args = [changed.get(args[i - 1], a) if i else a for i, a in enumerate(args)]
    assert set(changed) <= set(args), sorted(set(changed) - set(args))
    proc = run_cli("train_ppo_ray", args, nproc=1, timeout=600)
    log = proc.stdout + proc.stderr
    records = read_metrics(save)
    assert [r["step"] for r in records] == [1, 2], log[-3000:]
    assert "--use_kl_loss has no effect with --init_kl_coef 0" in log
    assert "colocated (hybrid): actor, engines share 1 device(s)" in log, log[-3000:]
    # the images reached the engine and the actor, whose weights (the language model's) the engine got each step
    assert all(r["rollout/logprob_diff"] < 1e-4 for r in records), series(records, "rollout/logprob_diff")
    assert records[1]["rollout/staleness_max"] == 0 and "train/kl_loss" not in records[0], records
    assert all(1.0 <= r["reward/label"] <= 4.0 for r in records), series(records, "reward/label")
