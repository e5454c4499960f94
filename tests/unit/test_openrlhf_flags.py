"""Every OpenRLHF flag of both generations is known to the matching openppo CLI.

`tests/assets/openrlhf_flags/`: the flag names OpenRLHF v0.9.10 (flat) and v0.11.0 (dotted) declare, per CLI, and
`table.json`, which gives each flag a value to pass and the config field it must land in (or says that openppo
refuses it with a reason, or accepts it as having no effect). The v0.11 optimizer flags built in a loop
(`--actor.adam.lr`, ...) are in the table though missing from the name list. A flag left out of the table fails.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from openppo.cli.flags_doc import clis
from openppo.config.schema import build_parser, parse_config

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "openrlhf_flags"
FLAT = json.loads((ASSETS / "v0.9.10-flat.json").read_text())
DOTTED = json.loads((ASSETS / "v0.11.0-dotted.json").read_text())
TABLE = json.loads((ASSETS / "table.json").read_text())
CONFIGS = clis()


def _field(cfg, path: str):
    for part in path.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _same(got, want) -> bool:
    if isinstance(got, (tuple, list)):
        return list(got) == list(want)
    return got == want


@pytest.mark.parametrize("cli", sorted(FLAT))
def test_every_flag_of_both_generations_is_in_the_table(cli):
    missing = (set(FLAT[cli]) | set(DOTTED[cli])) - set(TABLE[cli])
    assert not missing, f"{cli}: add these flags to tests/assets/openrlhf_flags/table.json: {sorted(missing)}"


@pytest.mark.parametrize("cli", sorted(FLAT))
def test_each_flag_lands_in_its_field_or_says_why_not(cli, capsys, caplog):
    config_cls = CONFIGS[cli]
    default = parse_config(config_cls, [], cli)
    for flag, entry in TABLE[cli].items():
        if entry.get("refused"):
            with pytest.raises(SystemExit):
                parse_config(config_cls, entry["argv"], cli)
            err = capsys.readouterr().err.strip()
            assert err.startswith(f"error: --{flag}: ") and "\n" not in err, (flag, err)
            continue
        with caplog.at_level(logging.WARNING):
            caplog.clear()
            cfg = parse_config(config_cls, entry["argv"], cli)
        if entry.get("no_effect"):
            assert " has no effect: " in caplog.text, flag
            assert cfg == default, flag
        elif entry["field"] is not None:
            got = _field(cfg, entry["field"])
            assert _same(got, entry["value"]), (flag, got, entry["value"])
            if not entry.get("only_choice"):
                assert not _same(_field(default, entry["field"]), entry["value"]), f"{flag}: the value is the default"


def test_a_dotted_recipe_and_a_flat_one_resolve_to_the_same_config():
    flat = (
        "--pretrain m --colocate_all_models --init_kl_coef 0.01 --zero_stage 2 --save_path out "
        "--max_norm 0.5 --actor_learning_rate 1e-6 --advantage_estimator group_norm --n_samples_per_prompt 4"
    )
    dotted = (
        "--actor.model_name_or_path m --train.colocate_all --algo.kl.init_coef 0.01 --ds.zero_stage 2 "
        "--ckpt.output_dir out --actor.max_norm 0.5 --critic.max_norm 0.5 --actor.adam.lr 1e-6 "
        "--algo.advantage.estimator group_norm --rollout.n_samples_per_prompt 4"
    )
    config_cls = CONFIGS["train_ppo_ray"]
    assert parse_config(config_cls, flat.split(), "t") == parse_config(config_cls, dotted.split(), "t")
    mixed = "--pretrain m --train.colocate_all --init_kl_coef 0.01 --ds.zero_stage 2".split()
    assert parse_config(config_cls, mixed, "t").resources.colocate_all_models  # generations mix across flags


@pytest.mark.parametrize(
    "argv,message",
    [
        ("--pretrain a --actor.model_name_or_path b", "--pretrain and --actor.model_name_or_path set the same option"),
        ("--zero_stage 2 --ds.zero_stage=2", "--zero_stage and --ds.zero_stage set the same option"),
        ("--actor.max_norm 1 --critic.max_norm 2", "set one option for both models in openppo (--max_norm)"),
        ("--rollout.max_new_tokens 8 --max_new_tokens 8", "set the same option (--generate_max_len)"),
        (
            "--vllm_async_scheduling --no-vllm.async_scheduling",
            "--vllm_async_scheduling and --no-vllm.async_scheduling set the same option (--vllm_async_scheduling)",
        ),
        ("--enable_prefix_caching --no-vllm.enable_prefix_caching", "set the same option (--enable_prefix_caching)"),
        ("--no-vllm_enable_chunked_prefill --vllm.enable_chunked_prefill", "set the same option"),
    ],
)
def test_one_setting_under_two_spellings_is_an_error_naming_both(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_config(CONFIGS["train_ppo_ray"], argv.split(), "train_ppo_ray")
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and err.count("\n") == 1, err


def test_a_switch_given_on_then_off_under_one_spelling_takes_the_last():
    config_cls = CONFIGS["train_ppo_ray"]
    cfg = parse_config(config_cls, "--vllm_async_scheduling --no-vllm_async_scheduling".split(), "train_ppo_ray")
    assert cfg.vllm.vllm_async_scheduling is False


def test_help_shows_the_flat_name_and_the_dotted_alias():
    text = build_parser(CONFIGS["train_ppo_ray"], "train_ppo_ray", "").format_help()
    assert "--colocate_all_models, --train.colocate_all" in text
    assert "--max_norm, --actor.max_norm, --critic.max_norm" in text


@pytest.mark.parametrize("cli", ["train_ppo_ray", "train_sft", "train_rm", "train_dpo"])
def test_help_loads_the_config_only(cli):
    """`--help` (and a bad flag) parse before anything runs: no model, data or cluster library is imported for it."""
    code = (
        "import sys\n"
        f"from openppo.cli.{cli} import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "heavy = ('transformers', 'datasets', 'deepspeed', 'ray', 'vllm')\n"
        "print('imported:', [m for m in heavy if m in sys.modules], file=sys.stderr)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "--pretrain" in proc.stdout and "imported: []" in proc.stderr, proc.stderr[-2000:]


def test_muon_turns_clipping_off_unless_given(capsys, caplog):
    """DeepSpeed's ZeRO-1/2/3 clip Muon's orthogonalised update, not the gradient (schema._muon_clipping): with
    `--optim muon` clipping is off unless `--max_norm` is given; a given norm stops a ZeRO >= 1 run, ZeRO-0 keeps it."""
    ppo, sft = CONFIGS["train_ppo_ray"], CONFIGS["train_sft"]
    with caplog.at_level(logging.INFO):
        cfg = parse_config(ppo, ["--actor.optim", "muon"], "train_ppo_ray")
    assert cfg.ds.optim == "muon" and cfg.train.max_norm == 0.0 and "gradient clipping off" in caplog.text
    assert parse_config(ppo, ["--actor.optim", "adam"], "train_ppo_ray").train.max_norm == 1.0
    assert parse_config(ppo, "--actor.optim muon --actor.max_norm 0".split(), "train_ppo_ray").train.max_norm == 0
    with pytest.raises(SystemExit):
        parse_config(ppo, "--actor.optim muon --actor.max_norm 1.0".split(), "train_ppo_ray")
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --actor.max_norm 1.0 with --optim muon: DeepSpeed's ZeRO-2") and "\n" not in err
    kept = parse_config(sft, "--optim muon --zero_stage 0 --max_norm 0.5".split(), "train_sft")
    assert kept.optim.max_norm == 0.5


def test_muon_settings_reach_the_strategy():
    """The Muon group's settings: Molt's own decay (`--actor.muon.weight_decay`, `--muon.weight_decay`), else --l2;
    none under AdamW."""
    from openppo.config.common import MuonSettings

    ppo, sft = CONFIGS["train_ppo_ray"], CONFIGS["train_sft"]
    argv = "--actor.optim muon --actor.muon.lr 0.01 --actor.muon.momentum 0.9 --actor.adam.weight_decay 0.05"
    ds = parse_config(ppo, argv.split(), "train_ppo_ray").ds
    assert ds.muon_settings(ds.l2) == MuonSettings(lr=0.01, momentum=0.9, weight_decay=0.05)
    ds = parse_config(ppo, (argv + " --actor.muon.weight_decay 0.2").split(), "train_ppo_ray").ds
    assert ds.muon_settings(ds.l2) == MuonSettings(lr=0.01, momentum=0.9, weight_decay=0.2)
    o = parse_config(sft, "--optim muon --muon.weight_decay 0.3".split(), "train_sft").optim
    assert o.muon_settings(o.l2) == MuonSettings(lr=0.02, momentum=0.95, weight_decay=0.3)
    o = parse_config(sft, [], "train_sft").optim
    assert o.muon_settings(o.l2) is None
    # what the CLIs hand `DeepSpeedStrategy.prepare_train` (tests/strategy/test_muon.py takes it from there)
    from openppo.ppo.workers import _optimizer_kwargs
    from openppo.trainers.setup import optimizer_kwargs

    cfg = parse_config(sft, "--optim muon --muon.lr 0.03".split(), "train_sft")
    assert optimizer_kwargs(cfg, 10)["muon"] == MuonSettings(lr=0.03, momentum=0.95, weight_decay=0.0)
    cfg = parse_config(ppo, argv.split(), "train_ppo_ray")
    assert _optimizer_kwargs(cfg, 1e-6, 10)["muon"] == MuonSettings(lr=0.01, momentum=0.9, weight_decay=0.05)
