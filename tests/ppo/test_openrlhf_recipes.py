"""Every training recipe OpenRLHF ships (v0.9.10 and v0.11.0, `tests/assets/openrlhf_flags/recipes.json`) gets past
openppo's checks as written, but for its model and data paths: it parses, validates (train_ppo_ray: the flags, then
the GPU-dependent checks; the supervised CLIs: `validate_common` under the launcher's 8 ranks) and, for
train_ppo_ray, its layout fits nodes of 8 GPUs. The one exception is named: v0.9.10's DAPO recipe passes a flag
OpenRLHF 0.9.10 does not declare either.

Then each of v0.11.0's recipes runs (slow: real Ray, DeepSpeed and vLLM on tiny models) with its paths and sizes
changed and nothing else: the five RL recipes here, the VLM recipe in tests/ppo/test_vlm_grpo.py, the async agent
recipe in tests/ppo/test_openrlhf_agent_recipe.py, and the four supervised ones here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from openppo.cli.flags_doc import clis
from openppo.config.schema import parse_config
from tests.model_cache import tiny_model_dir, tiny_vlm_dir

RECIPES = json.loads((Path(__file__).resolve().parents[1] / "assets/openrlhf_flags/recipes.json").read_text())
CASES = [(tag, name, recipe) for tag, scripts in RECIPES.items() for name, recipe in scripts.items()]
MODEL_FLAGS = {"--pretrain", "--actor.model_name_or_path", "--model.model_name_or_path", "--reward_pretrain"}
MODEL_FLAGS |= {"--reward.model_name_or_path", "--critic_pretrain", "--critic.model_name_or_path"}
DATA_FLAGS = {"--prompt_data", "--data.prompt_dataset", "--dataset", "--data.dataset", "--eval_dataset"}
DATA_FLAGS |= {"--eval.dataset"}
AGENT_FLAGS = {"--agent_func_path", "--train.agent_func_path"}
REWARD_FLAGS = {"--remote_rm_url", "--reward.remote_url"}
BROKEN = {("v0.9.10", "train_dapo_ray_hybrid_engine.sh"): "--vllm_enable_is_correction"}
GPUS_PER_NODE = 8


def test_every_recipe_of_both_generations_is_here():
    assert {tag: len(scripts) for tag, scripts in RECIPES.items()} == {"v0.9.10": 10, "v0.11.0": 11}
    assert {r["cli"] for _, _, r in CASES} == {"train_ppo_ray", "train_sft", "train_rm", "train_dpo"}


def _local(args: list[str], name: str, tmp_path: Path) -> list[str]:
    """The recipe's arguments with its models, data and files replaced by local ones."""
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"prompt": "p", "label": "1"}) + "\n")
    reward = tmp_path / "reward_func.py"
    reward.write_text("def reward_func(queries, prompts, labels, **kwargs):\n    return [0.0] * len(queries)\n")
    model = str(tiny_vlm_dir() if "vlm" in name else tiny_model_dir())
    out = list(args)
    for i, flag in enumerate(out[:-1]):
        if flag in MODEL_FLAGS:
            out[i + 1] = model
        elif flag in DATA_FLAGS:
            out[i + 1] = str(data)
        elif flag in AGENT_FLAGS:
            out[i + 1] = str(Path(__file__).resolve().parents[1] / "agents/openrlhf_vowels_agent.py")
        elif flag in REWARD_FLAGS and out[i + 1].endswith(".py"):
            out[i + 1] = str(reward)
    return out


@pytest.mark.parametrize("tag, name, recipe", CASES, ids=[f"{t}-{n}" for t, n, _ in CASES])
def test_openrlhfs_recipe_passes_openppos_checks(tag, name, recipe, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # (the recipes' relative output folders)
    cli, args = recipe["cli"], _local(recipe["args"], name, tmp_path)
    if (tag, name) in BROKEN:
        with pytest.raises(SystemExit):
            parse_config(clis()[cli], args, f"openrlhf.cli.{cli}")
        flag = BROKEN[tag, name]
        assert f"unrecognized arguments: {flag}; did you mean --enable_vllm_is_correction?" in capsys.readouterr().err
        return
    cfg = parse_config(clis()[cli], args, f"openrlhf.cli.{cli}")
    if cli != "train_ppo_ray":
        from openppo.trainers.setup import validate_common

        monkeypatch.setenv("WORLD_SIZE", str(GPUS_PER_NODE))  # the recipes launch deepspeed on one 8-GPU node
        validate_common(cfg)
        return
    from openppo.ppo import launch
    from openppo.ppo.plan import make_plan
    from openppo.ppo.validate import validate_devices, validate_flags

    validate_flags(cfg)
    if cfg.ds.param_dtype == "auto":  # (resolved on the cluster's GPUs: bf16 on the H100-class GPUs they name)
        cfg.ds.param_dtype = "bf16"
    validate_devices(cfg, on_gpu=True)
    plan = make_plan(cfg, num_prompts=100_000)
    nodes = max(cfg.resources.actor_num_nodes, 1)
    devices = launch.ClusterDevices(True, GPUS_PER_NODE * nodes, False, (("node", GPUS_PER_NODE),) * nodes)
    launch.check_layout_fits(cfg, plan, devices)


# sizes of the runs below: one rank and one engine per group, small batches and lengths, fp32 (bf16 is up to 58x
# slower on a CPU without AVX512_BF16), 2 steps; every other flag as the recipe gives it
RUN_SIZES = {
    "--train.batch_size": "8",
    "--rollout.batch_size": "2",
    "--rollout.n_samples_per_prompt": "4",
    "--data.max_len": "128",
    "--rollout.max_new_tokens": "16",
    "--ds.param_dtype": "fp32",
    "--train.num_episodes": "1",
    "--data.max_samples": "64",
    "--train.max_tokens_per_gpu": "512",
    "--rollout.max_tokens_per_gpu": "1024",
    "--train.micro_batch_size": "2",
    "--rollout.micro_batch_size": "4",
    "--rollout.vllm_generate_batch_size": "2",
    "--eval.n_samples_per_prompt": "1",
}
# the ones with a test of their own: tests/ppo/test_vlm_grpo.py, tests/ppo/test_openrlhf_agent_recipe.py
RUNS = [n for n, r in RECIPES["v0.11.0"].items() if r["cli"] == "train_ppo_ray" and "vlm" not in n and "agent" not in n]


def test_every_train_ppo_ray_recipe_is_run():
    assert len(RUNS) == 5, RUNS


@pytest.mark.slow
@pytest.mark.parametrize("name", RUNS)
def test_openrlhfs_recipe_runs_as_written(name, tmp_path):
    """The recipe's command line with its paths and sizes changed (and a reward function that scores by length, so
    that groups differ), nothing else: 2 steps, the engine's log-probs the trainer's (fp32) on each."""
    from tests.cli.helpers import read_metrics, run_cli

    args = _local(RECIPES["v0.11.0"][name]["args"], name, tmp_path)
    # the files _local points the recipe at, now with prompts to train on (under the recipe's column names) and
    # rewards that differ within a group
    keys = {flag: args[args.index(flag) + 1] for flag in ("--data.input_key", "--data.label_key") if flag in args}
    question, answer = keys.get("--data.input_key", "input"), keys.get("--data.label_key", "label")
    rows = [{question: f"What is {i} plus {i + 1}?", answer: str(2 * i + 1)} for i in range(64)]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "reward_func.py").write_text(
        "def reward_func(queries, prompts, labels, **kwargs):\n"
        "    rewards = [len(q) % 3 / 2 for q in queries]\n"
        "    return {'rewards': rewards, 'scores': rewards, 'extra_logs': {}}\n"
    )
    save = tmp_path / "out"
    sizes = {**RUN_SIZES, "--ckpt.output_dir": str(save), "--ckpt.path": str(save / "ckpt")}
    sizes["--logger.tensorboard_dir"] = str(save / "tensorboard")
    sizes["--logger.wandb.key"] = "offline"  # (the recipe's `{wandb_token}` placeholder)
    if "--rollout.n_samples_per_prompt" not in args:  # (one sample a prompt: a step of 2)
        sizes["--train.batch_size"] = "2"
    args = [_sized(args, i, sizes) for i in range(len(args))] + ["--max_steps", "2"]
    proc = run_cli("train_ppo_ray", args, nproc=1, timeout=600)
    records = read_metrics(save)
    assert [r["step"] for r in records] == [1, 2], (proc.stdout + proc.stderr)[-3000:]
    assert all(r["rollout/logprob_diff"] < 1e-4 for r in records), [r["rollout/logprob_diff"] for r in records]


def _sized(args: list[str], i: int, sizes: dict[str, str]) -> str:
    """Argument i, resized: a value after a flag in `sizes`, and one rank or engine per group."""
    flag = args[i - 1] if i else ""
    if flag in sizes:
        return sizes[flag]
    if flag.endswith((".num_gpus_per_node", ".num_engines", ".tensor_parallel_size", ".ring_attn_size")):
        return "1"
    if flag.endswith(".ring_attn_head_stride"):
        return "1"
    return args[i]


SUPERVISED = [n for n, r in RECIPES["v0.11.0"].items() if r["cli"] != "train_ppo_ray"]


@pytest.mark.slow
@pytest.mark.parametrize("name", SUPERVISED)
def test_openrlhfs_supervised_recipe_runs_as_written(name, tmp_path):
    """SFT (a dense model, and Mixtral with LoRA and the router loss: a tiny Qwen3-MoE here), the reward model and
    DPO, from their command lines with paths and sizes changed: each trains and exports a model."""
    from tests.cli.helpers import run_cli

    def chat(answer: str) -> list[dict]:
        return [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": answer}]

    rows = [
        {"question": f"What is {i} + 1?", "response": str(i + 1), "chosen": chat("4"), "rejected": chat("5")}
        for i in range(8)
    ]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    save = tmp_path / "out"
    sizes = {
        "--model.model_name_or_path": str(tiny_model_dir(arch="qwen3_moe") if "mixtral" in name else tiny_model_dir()),
        "--data.dataset": str(data),
        "--ckpt.output_dir": str(save),
        "--train.batch_size": "4",
        "--train.micro_batch_size": "2",
        "--data.max_len": "64",
        "--ds.param_dtype": "fp32",
        "--data.max_samples": "8",
    }
    args = RECIPES["v0.11.0"][name]["args"]
    args = [_sized(args, i, sizes) for i in range(len(args))]
    run_cli(RECIPES["v0.11.0"][name]["cli"], args, nproc=1, timeout=600)
    assert any(save.glob("*.safetensors")), sorted(p.name for p in save.iterdir())
