"""Every training recipe OpenRLHF ships (v0.9.10 and v0.11.0, `tests/assets/openrlhf_flags/recipes.json`) gets past
openppo's checks as written, but for its model and data paths: it parses, validates (train_ppo_ray: the flags, then
the GPU-dependent checks; the supervised CLIs: `validate_common` under the launcher's 8 ranks) and, for
train_ppo_ray, its layout fits nodes of 8 GPUs. Nothing is launched. The one exception is named: v0.9.10's DAPO
recipe passes a flag OpenRLHF 0.9.10 does not declare either.

The runs themselves: tests/ppo/test_openrlhf_agent_recipe.py (the async agent recipe), tests/ppo/test_vlm_grpo.py
(image prompts), tests/ppo/test_train_ppo_ray.py (the dotted hybrid-engine flags).
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
