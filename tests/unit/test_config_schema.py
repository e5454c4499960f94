"""The typed config -> flat flags layer."""

import subprocess
import sys

from openppo.config.schema import flag_names, parse_config
from openppo.trainers.configs import DPOConfig, RMConfig, SFTConfig

OPENRLHF_FLAGS = [
    "--pretrain",
    "--dataset",
    "--input_key",
    "--output_key",
    "--max_len",
    "--train_batch_size",
    "--micro_train_batch_size",
    "--max_epochs",
    "--learning_rate",
    "--zero_stage",
    "--save_path",
    "--ckpt_path",
    "--save_steps",
    "--load_checkpoint",
    "--lora_rank",
    "--adam_offload",
    "--gradient_checkpointing",
    "--overlap_comm",
    "--max_norm",
    "--max_ckpt_num",
    "--packing_samples",
    "--apply_chat_template",
    "--input_template",
    "--use_wandb",
    "--use_tensorboard",
    "--lr_warmup_ratio",
]


def test_sft_has_openrlhf_flags():
    names = set(flag_names(SFTConfig))
    assert not [f for f in OPENRLHF_FLAGS if f not in names]


def test_preference_flags():
    for cls in (RMConfig, DPOConfig):
        names = set(flag_names(cls))
        assert {"--chosen_key", "--rejected_key", "--prompt_key"} <= names
    assert {"--beta", "--ipo", "--label_smoothing", "--nll_loss_coef", "--ref_pretrain"} <= set(flag_names(DPOConfig))


def test_parse_nested_and_types():
    cfg = parse_config(
        SFTConfig,
        [
            "--pretrain",
            "m",
            "--zero_stage",
            "3",
            "--adam_betas",
            "0.9",
            "0.99",
            "--packing_samples",
            "--target_modules",
            "q_proj",
            "v_proj",
            "--use_wandb",
        ],
        "t",
    )
    assert cfg.model.pretrain == "m" and cfg.ds.zero_stage == 3 and cfg.data.packing_samples
    assert cfg.optim.adam_betas == (0.9, 0.99) and cfg.model.target_modules == ["q_proj", "v_proj"]
    assert cfg.logging.use_wandb == "auto"
    assert parse_config(SFTConfig, [], "t").logging.use_wandb is None


def test_bad_choice_is_one_line_naming_the_flag():
    proc = subprocess.run(
        [sys.executable, "-m", "openppo.cli.train_sft", "--zero_stage", "4"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--zero_stage" in lines[0] and "choose from" in lines[0], proc.stderr


def test_every_flag_has_help():
    from openppo.config.schema import build_parser

    for cls in (SFTConfig, RMConfig, DPOConfig):
        for action in build_parser(cls, "t", "")._actions:
            if action.option_strings and action.dest not in ("help", "local_rank"):
                assert action.help and not action.help.startswith("(default"), action.dest


def test_a_truncated_flag_is_refused_naming_the_full_one():
    """argparse's default `allow_abbrev` took `--pretrai` for `--pretrain` (and `--zero 3` for `--zero_stage 3`)."""
    from openppo.ppo.config import PPOConfig

    for argv, closest in ((["--pretrai", "m"], "--pretrain"), (["--zero", "3"], None), (["--seed=3"], None)):
        proc = subprocess.run(
            [
                sys.executable,
                "-c",
                f"from openppo.config.schema import parse_config as p; "
                f"from openppo.ppo.config import PPOConfig; p(PPOConfig, {argv!r}, 't')",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if argv == ["--seed=3"]:  # the full name, with "=", still parses
            assert proc.returncode == 0, proc.stderr
            continue
        assert proc.returncode == 2, (argv, proc.stderr)
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and f"unrecognized arguments: {argv[0]}" in lines[0], proc.stderr
        assert (f"did you mean {closest}?" in lines[0]) if closest else "did you mean" not in lines[0], lines[0]
    assert parse_config(PPOConfig, ["--pretrain", "m"], "t").model.pretrain == "m"
