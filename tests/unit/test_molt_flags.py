"""Molt's flags against openppo's CLIs (issue 36), from `tests/assets/molt_flags/`.

Molt (NVIDIA-NeMo/labs-molt, OpenRLHF's successor) keeps OpenRLHF's dotted names. `molt-0.1.6.json` lists the flags
its two CLIs declare and those its 12 example scripts pass (`extract.py` wrote it from Molt's source). Each flag is
known to the matching openppo CLI by that exact name (abbreviations are refused), or refused before anything starts
with one line naming it and the reason, or listed in `pending.json`: the flags openppo does not know yet. The
pending lists only shrink: a flag that becomes known must leave them, and a known flag cannot fall back. Names only:
whether a known flag does what it does in Molt (its values, its meaning) is for the flag table to show.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import json
import logging
from pathlib import Path

import pytest

from openppo.algorithms import IS_CORRECTION_TYPES
from openppo.cli.flags_doc import clis
from openppo.config import openrlhf_names
from openppo.config.schema import build_parser, parse_config

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "molt_flags"
MOLT = json.loads((ASSETS / "molt-0.1.6.json").read_text())
PENDING = json.loads((ASSETS / "pending.json").read_text())
CLIS = ("train_ppo_ray", "train_sft")


@functools.cache
def options(cli: str) -> frozenset[str]:
    return frozenset(build_parser(clis()[cli], cli, "")._option_string_actions)


def status(cli: str, flag: str) -> str:
    """The flag is "known", "refused" (one line: `error: --flag: why ...`) or "unknown"."""
    config_cls = clis()[cli]
    if f"--{flag}" in options(cli):
        return "known"
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit):
        parse_config(config_cls, [f"--{flag}"], cli)
    message = err.getvalue().strip()
    return "refused" if message.startswith(f"error: --{flag}: ") and "\n" not in message else "unknown"


def test_the_recipes_pass_declared_flags_of_their_cli():
    assert len(MOLT["recipes"]) == 12 and {r["cli"] for r in MOLT["recipes"].values()} == set(CLIS)
    for path, recipe in MOLT["recipes"].items():
        undeclared = set(recipe["flags"]) - set(MOLT["declared"][recipe["cli"]])
        assert not undeclared, f"{path}: {sorted(undeclared)}"


@pytest.mark.parametrize("cli", CLIS)
def test_every_molt_flag_is_known_refused_or_pending(cli):
    flags = sorted(MOLT["declared"][cli])
    unknown = [f for f in flags if status(cli, f) == "unknown"]
    newly_known = sorted(set(PENDING[cli]) - set(unknown))
    assert not newly_known, f"{cli}: these Molt flags now work; take them out of pending.json: {newly_known}"
    lost = sorted(set(unknown) - set(PENDING[cli]))
    assert not lost, f"{cli}: these Molt flags are unknown to openppo: {lost}"


# Molt's names for settings openppo has under another name (`openrlhf_names.MOLT_*`): (Molt's, openppo's, a value)
RENAMED = {
    "train_sft": [
        ("ckpt.disable_final_save", "disable_final_save", []),
        ("ckpt.dcp_max_num", "max_resumable_ckpt_num", ["2"]),
        ("fsdp.tp_size", "ds.tensor_parallel_size", ["4"]),
        ("fsdp.cp_size", "ds.ring_attn_size", ["4"]),
        ("fsdp.param_dtype", "ds.param_dtype", ["fp16"]),
        ("fsdp.packing_samples", "ds.packing_samples", []),
        ("fsdp.attn_implementation", "ds.attn_implementation", ["eager"]),
    ],
}
RENAMED["train_ppo_ray"] = RENAMED["train_sft"] + [
    ("algo.advantage.lam", "algo.advantage.lambd", ["0.25"]),
    ("train.check_weight_update_equal", "vllm_sync_check", []),
    ("algo.advantage.no_whiten", "no_advantage_whiten", []),
    ("actor.freezing_steps", "freezing_actor_steps", ["3"]),
    ("critic.max_epochs", "critic_max_epochs", ["2"]),
    ("train.colocate_fsdp_models", "colocate_actor_ref", []),
    # vLLM's engine settings, passed through (`VLLMConfig.engine_args`)
    ("vllm.dtype", "vllm_dtype", ["float32"]),
    ("vllm.block_size", "vllm_block_size", ["64"]),
    ("vllm.max_num_batched_tokens", "vllm_max_num_batched_tokens", ["4096"]),
    ("vllm.enable_chunked_prefill", "vllm_enable_chunked_prefill", []),
    ("no-vllm.enable_chunked_prefill", "no-vllm_enable_chunked_prefill", []),
    ("vllm.async_scheduling", "vllm_async_scheduling", []),
    ("no-vllm.async_scheduling", "no-vllm_async_scheduling", []),
    ("vllm.attention_backend", "vllm_attention_backend", ["TRITON_ATTN"]),
    ("vllm.mm_encoder_attn_backend", "vllm_mm_encoder_attn_backend", ["TORCH_SDPA"]),
    ("vllm.gdn_prefill_backend", "vllm_gdn_prefill_backend", ["triton"]),
    ("vllm.mamba_ssm_cache_dtype", "vllm_mamba_ssm_cache_dtype", ["float32"]),
    ("vllm.disable_custom_all_reduce", "vllm_disable_custom_all_reduce", []),
]

RENAMED["train_sft"] = RENAMED["train_sft"] + [("data.train_on_last_turn_only", "train_on_last_turn_only", [])]


@pytest.mark.parametrize("cli", CLIS)
def test_molt_names_set_what_openppo_names_set(cli):
    config_cls = clis()[cli]
    default = parse_config(config_cls, [], cli)
    for molt, ours, value in RENAMED[cli]:
        assert molt.removeprefix("no-") in MOLT["declared"][cli], molt
        got = parse_config(config_cls, [f"--{molt}", *value], cli)
        assert got == parse_config(config_cls, [f"--{ours}", *value], cli) and got != default, molt


def test_molt_names_for_values(caplog):
    """Molt's `grpo` estimator is openppo's group_norm (the same formula), in either flag spelling."""
    config_cls = clis()["train_ppo_ray"]
    ours = parse_config(config_cls, ["--advantage_estimator", "group_norm"], "t")
    with caplog.at_level(logging.INFO):
        assert parse_config(config_cls, ["--algo.advantage.estimator", "grpo"], "t") == ours
        assert parse_config(config_cls, ["--advantage_estimator=grpo"], "t") == ours
    assert "--algo.advantage.estimator grpo: Molt's name for openppo's group_norm" in caplog.text
    assert parse_config(config_cls, ["--input_key", "grpo"], "t").data.input_key == "grpo"  # other flags' values


def test_sft_image_cap_without_the_column_says_so(caplog):
    """Molt's `--data.max_images_per_prompt` without `--data.image_key` trains on text only, and says so in one
    line (train_ppo_ray's `--image_key` without the cap: tests/ppo/test_validate.py)."""
    from openppo.cli.train_sft import image_processor

    sft = parse_config(clis()["train_sft"], ["--data.max_images_per_prompt", "2"], "t")
    with caplog.at_level(logging.INFO):
        assert image_processor(sft) is None
    assert "note: --max_images_per_prompt has no effect without --image_key" in caplog.text


@pytest.mark.parametrize(
    "cli, flag", [("train_ppo_ray", "actor.gradient_checkpoint"), ("train_sft", "model.gradient_checkpoint")]
)
def test_molt_checkpoint_modes(cli, flag, caplog, capsys):
    config_cls = clis()[cli]
    off, on = parse_config(config_cls, [], cli), parse_config(config_cls, ["--gradient_checkpointing"], cli)
    assert on != off
    with caplog.at_level(logging.INFO):
        for argv in ([f"--{flag}"], [f"--{flag}", "full"], [f"--{flag}=full"], [f"--{flag}", "selective"]):
            assert parse_config(config_cls, argv, cli) == on, argv
    assert "selective: openppo checkpoints whole layers (full) instead" in caplog.text
    for mode in ("none", "off", ""):
        assert parse_config(config_cls, ["--gradient_checkpointing", f"--{flag}={mode}"], cli) == off, mode
    with pytest.raises(SystemExit):
        parse_config(config_cls, [f"--{flag}", "partial"], cli)
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: argument --{flag}: ") and "choose full, selective or none" in err and "\n" not in err


@pytest.mark.parametrize("cli", CLIS)
def test_fsdp_only_parallelism_is_refused_unless_it_asks_for_nothing(cli, capsys, caplog):
    config_cls = clis()[cli]
    default = parse_config(config_cls, [], cli)
    with caplog.at_level(logging.INFO):
        assert parse_config(config_cls, ["--fsdp.ep_size", "1", "--fsdp.pp_size=1"], cli) == default
    assert "--fsdp.ep_size 1 has no effect" in caplog.text and "--fsdp.pp_size 1 has no effect" in caplog.text
    for argv, reason in (
        (["--fsdp.ep_size", "8"], "--zero_stage 3"),
        (["--fsdp.pp_size", "2"], "--ds_tensor_parallel_size"),
        (["--fsdp.sequence_parallel"], "--ring_attn_size"),
    ):
        with pytest.raises(SystemExit):
            parse_config(config_cls, argv, cli)
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: {' '.join(argv)}: ") and reason in err and "\n" not in err, err


@pytest.mark.parametrize("cli", CLIS)
def test_molt_offload_levels(cli, capsys):
    config_cls = clis()[cli]
    default = parse_config(config_cls, [], cli)
    assert parse_config(config_cls, ["--fsdp.offload", "none"], cli) == default
    assert parse_config(config_cls, ["--fsdp.offload=optimizer"], cli) == parse_config(
        config_cls, ["--adam_offload"], cli
    )
    for level, reason in (("full", "--adam_offload"), ("disk", "choose none or optimizer")):
        with pytest.raises(SystemExit):
            parse_config(config_cls, ["--fsdp.offload", level], cli)
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: argument --fsdp.offload: ") and reason in err and "\n" not in err, err


def test_molt_is_correction_level_and_mode(capsys, caplog):
    """Molt's IS correction (level x mode) turns openppo's correction on with the type of the same formula."""
    config_cls = clis()["train_ppo_ray"]
    default = parse_config(config_cls, [], "t")

    def molt(level, *mode):
        argv = ["--algo.advantage.is_correction_level", level]
        return parse_config(config_cls, argv + (["--algo.advantage.is_correction_mode", *mode] if mode else []), "t")

    def ours(kind):
        return parse_config(config_cls, ["--enable_vllm_is_correction", "--vllm_is_correction_type", kind], "t")

    for (level, mode), kind in {
        ("token", "clip"): "tis",
        ("token", "mask"): "icepop",
        ("token", "trunc"): "token-trunc",
        ("seq", "mask"): "seq-mask",
        ("geo", "mask"): "geo-mask",
    }.items():
        assert molt(level, mode) == ours(kind) != default, (level, mode)
    assert molt("geo") == ours("geo-mask")  # Molt's default mode is mask
    assert set(openrlhf_names.MOLT_IS_CORRECTION.values()) <= set(IS_CORRECTION_TYPES)
    with caplog.at_level(logging.INFO):
        assert molt("off", "clip") == default
    assert "is_correction_mode clip has no effect" in caplog.text
    for argv, reason in (
        (["--algo.advantage.is_correction_level", "geo", "--algo.advantage.is_correction_mode", "clip"], "mask"),
        (["--algo.advantage.is_correction_level", "token", "--vllm_is_correction_type", "tis"], "give it once"),
    ):
        with pytest.raises(SystemExit):
            parse_config(config_cls, argv, "t")
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: --algo.advantage.is_correction_level ") and reason in err and "\n" not in err


def test_molt_cispo_ceiling_is_openppo_offset(capsys):
    """`--actor.loss_mode cispo` is Molt's: its clip pair's high value is the ratio's ceiling, openppo's the offset."""
    config_cls = clis()["train_ppo_ray"]
    ours = parse_config(config_cls, ["--policy_loss_type", "cispo", "--eps_clip_low_high", "0.2", "0.25"], "t")
    got = parse_config(config_cls, ["--actor.loss_mode", "cispo", "--actor.eps_clip_low_high", "0.2", "1.25"], "t")
    assert got.algo.policy_loss_type == "cispo" and got.algo.eps_clip_low_high == pytest.approx((0.2, 0.25))
    assert dataclasses.replace(got, algo=dataclasses.replace(got.algo, eps_clip_low_high=(0.2, 0.25))) == ours
    # ppo keeps the offset in either spelling, and cispo without the pair keeps openppo's default (ceiling 1.2)
    ppo = parse_config(config_cls, ["--actor.loss_mode", "ppo", "--actor.eps_clip_low_high", "0.2", "0.28"], "t")
    assert ppo.algo.eps_clip_low_high == (0.2, 0.28)
    assert parse_config(config_cls, ["--actor.loss_mode", "cispo"], "t").algo.eps_clip_low_high is None
    with pytest.raises(SystemExit):
        parse_config(config_cls, ["--actor.loss_mode", "cispo", "--actor.eps_clip_low_high", "0.2", "0.28"], "t")
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --actor.eps_clip_low_high 0.2 0.28: ") and "ceiling" in err and "\n" not in err


def test_vllm_settings_reach_the_engine_arguments():
    """What the pass-through flags give vLLM: unset ones nothing (vLLM's choice), off switches False, and the GPU
    kernel choices only on GPU."""
    config_cls = clis()["train_ppo_ray"]
    assert parse_config(config_cls, [], "t").vllm.engine_args(on_gpu=True) == {}
    argv = ["--vllm.block_size", "64", "--vllm.max_num_batched_tokens", "4096", "--no-vllm.enable_chunked_prefill"]
    argv += ["--no-vllm.async_scheduling", "--vllm.mamba_ssm_cache_dtype", "float32"]
    gpu_only = ["--vllm.attention_backend", "TRITON_ATTN", "--vllm.gdn_prefill_backend", "triton"]
    gpu_only += ["--vllm.mm_encoder_attn_backend", "TORCH_SDPA", "--vllm.disable_custom_all_reduce"]
    v = parse_config(config_cls, argv + gpu_only, "t").vllm
    common = {
        "block_size": 64,
        "max_num_batched_tokens": 4096,
        "enable_chunked_prefill": False,
        "async_scheduling": False,
        "mamba_ssm_cache_dtype": "float32",
    }
    assert v.engine_args(on_gpu=False) == common
    assert v.engine_args(on_gpu=True) == {
        **common,
        "attention_backend": "TRITON_ATTN",
        "gdn_prefill_backend": "triton",
        "mm_encoder_attn_backend": "TORCH_SDPA",
        "disable_custom_all_reduce": True,
    }
    # Molt's prefix-caching switch is off by default, like openppo's; its negative form leaves it off
    assert not parse_config(config_cls, ["--no-vllm.enable_prefix_caching"], "t").vllm.enable_prefix_caching
    assert parse_config(config_cls, ["--vllm.enable_prefix_caching"], "t").vllm.enable_prefix_caching


def test_molt_engine_settings_without_counterpart(capsys, caplog):
    """Molt's engine parallelism and speculative decoding: the value that asks for nothing passes with one line, any
    other stops; its executor, router and runner settings do nothing here, each said in one line."""
    config_cls = clis()["train_ppo_ray"]
    default = parse_config(config_cls, [], "t")
    asks_nothing = ["--vllm.pipeline_parallel_size", "1", "--vllm.data_parallel_size", "1"]
    asks_nothing += ["--vllm.decode_context_parallel_size", "1", "--vllm.mtp_num_speculative_tokens", "0"]
    ignored = ["--vllm.distributed_executor_backend", "mp", "--vllm.router_policy", "round_robin"]
    ignored += ["--rollout.num_runners", "4", "--ckpt.warm_resume_rollouts"]
    with caplog.at_level(logging.INFO):
        assert parse_config(config_cls, asks_nothing + ignored, "t") == default
    for name in ("pipeline_parallel_size 1", "data_parallel_size 1", "mtp_num_speculative_tokens 0"):
        assert f"--vllm.{name} has no effect" in caplog.text, name
    for name in (
        "vllm.distributed_executor_backend",
        "vllm.router_policy",
        "rollout.num_runners",
        "ckpt.warm_resume_rollouts",
    ):
        assert f"--{name} has no effect: " in caplog.text, name
    for argv, reason in (
        (["--vllm.pipeline_parallel_size", "2"], "--vllm_tensor_parallel_size"),
        (["--vllm.data_parallel_size", "4"], "--vllm_num_engines"),
        (["--vllm.decode_context_parallel_size", "2"], "--vllm_tensor_parallel_size"),
        (["--vllm.mtp_num_speculative_tokens", "1"], "speculative decoding"),
        (["--vllm.enable_expert_parallel"], "tensor parallelism"),
    ):
        with pytest.raises(SystemExit):
            parse_config(config_cls, argv, "t")
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"error: {' '.join(argv)}: ") and reason in err and "\n" not in err, err
    # train_sft has no engines: Molt's SFT declares none of these
    with pytest.raises(SystemExit):
        parse_config(clis()["train_sft"], ["--vllm.pipeline_parallel_size", "1"], "train_sft")


def test_molt_on_policy_distill_is_a_teacher_run(capsys, tmp_path):
    """Molt's on_policy_distill distils from --ref.model_name_or_path: openppo's --teacher_pretrain run with no task
    reward and no KL-to-start reference. Its reference path otherwise may only be the actor's own weights."""
    config_cls = clis()["train_ppo_ray"]
    base = ["--actor.model_name_or_path", "student", "--rollout.n_samples_per_prompt", "4"]
    molt = ["--algo.advantage.estimator", "on_policy_distill", "--ref.model_name_or_path", "teacher"]
    ours = ["--teacher_pretrain", "teacher", "--advantage_estimator", "group_norm", "--init_kl_coef", "0"]
    assert parse_config(config_cls, base + molt, "t") == parse_config(config_cls, base + ours, "t")
    assert parse_config(config_cls, base + molt + ["--algo.kl.init_coef", "1"], "t").model.teacher_pretrain == [
        "teacher"
    ]
    # the actor's own folder as the reference is openppo's reference already
    (tmp_path / "student").mkdir()
    same = ["--pretrain", str(tmp_path / "student"), "--ref.model_name_or_path", str(tmp_path / "student")]
    assert parse_config(config_cls, same, "t") == parse_config(config_cls, same[:2], "t")
    for argv, reason in (
        (["--algo.advantage.estimator", "on_policy_distill"], "the teacher is --ref.model_name_or_path"),
        (molt + ["--teacher_pretrain", "other"], "give it once"),
        (molt + ["--algo.kl.init_coef", "0.5"], "--distill_task_coef"),
        (["--ref.model_name_or_path", "other"], "--teacher_pretrain"),
    ):
        with pytest.raises(SystemExit):
            parse_config(config_cls, base + argv, "t")
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: --") and reason in err and "\n" not in err, err


def test_a_molt_recipe_runs_async(caplog):
    """Molt generates ahead of training unless --train.force_sync_mode, and its --rollout.vllm_generate_batch_size
    caps the prompts in flight: a whole recipe of dotted names with one of Molt's own runs with --async_train, and a
    cap below the batch has no effect; a recipe with a flat name, or OpenRLHF's dotted names only, keeps the
    default, and so does a Molt flag alone (not a recipe: no model)."""
    config_cls = clis()["train_ppo_ray"]
    molt = ["--actor.model_name_or_path", "m", "--fsdp.param_dtype", "fp32", "--rollout.batch_size", "4"]
    molt += ["--rollout.vllm_generate_batch_size", "2"]
    with caplog.at_level(logging.INFO):
        r = parse_config(config_cls, molt + ["--train.async_queue_size", "2"], "t").rollout
    assert r.async_train and r.async_queue_size == 2 and r.vllm_generate_batch_size is None
    assert "a Molt recipe (--fsdp.param_dtype): batches are generated ahead of training" in caplog.text
    assert "--rollout.vllm_generate_batch_size 2 has no effect: Molt's cap on the prompts in flight" in caplog.text
    # a cap above the batch generates the surplus ahead in both
    assert parse_config(config_cls, molt[:-1] + ["6"], "t").rollout.vllm_generate_batch_size == 6
    strict = parse_config(config_cls, molt + ["--train.force_sync_mode"], "t").rollout
    assert not strict.async_train and strict.force_sync_mode
    openrlhf = ["--actor.model_name_or_path", "m", "--rollout.batch_size", "4", "--train.async_queue_size", "2"]
    images = openrlhf + ["--data.image_key", "images"]  # Molt's SFT name, but OpenRLHF's RL one too
    for other in (molt + ["--seed", "1"], openrlhf, images, molt[2:]):
        r = parse_config(config_cls, other, "t").rollout
        assert not r.async_train, other
    assert parse_config(config_cls, molt + ["--seed", "1"], "t").rollout.vllm_generate_batch_size == 2
