"""Every OpenRLHF flag of both generations is known to the matching openppo CLI.

`tests/assets/openrlhf_flags/`: the flag names OpenRLHF v0.9.10 (flat) and v0.11.0 (dotted) declare, per CLI, and
`table.json`, which gives each flag a value to pass and the config field it must land in (or says that openppo
refuses it with a reason, or accepts it as having no effect). The v0.11 optimizer flags built in a loop
(`--actor.adam.lr`, ...) are in the table though missing from the name list. A flag left out of the table fails.
"""

from __future__ import annotations

import json
import logging
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
    ],
)
def test_one_setting_under_two_spellings_is_an_error_naming_both(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_config(CONFIGS["train_ppo_ray"], argv.split(), "train_ppo_ray")
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and message in err and err.count("\n") == 1, err


def test_help_shows_the_flat_name_and_the_dotted_alias():
    text = build_parser(CONFIGS["train_ppo_ray"], "train_ppo_ray", "").format_help()
    assert "--colocate_all_models, --train.colocate_all" in text
    assert "--max_norm, --actor.max_norm, --critic.max_norm" in text
