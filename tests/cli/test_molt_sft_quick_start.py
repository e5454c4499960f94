"""Molt's SFT quick-start (examples/scripts/quick_start/sft_qwen3_4b.sh, Molt 0.1.6) on train_sft, flag for flag in
Molt's spelling, with paths and sizes changed to a tiny Qwen3 on CPU.

Its rows are chat messages under `prompt` with the reply under `response`, and it passes no
--data.apply_chat_template: Molt's train_sft has none and renders every row as a chat. The recipe is told by its
Molt-only names (`--fsdp.*`, `--model.gradient_checkpoint`) and runs with the template, said in one line.
"""

from __future__ import annotations

import json

import pytest

from openppo.cli.flags_doc import clis
from openppo.config.schema import parse_config
from tests.cli.helpers import read_metrics, run_cli
from tests.model_cache import tiny_model_dir


def quick_start_args(model, data, eval_data, save) -> list[str]:
    """The script's flags in its order; a comment gives the script's value where this one differs."""
    return [
        *("--data.max_len", "64"),  # 4096
        *("--data.dataset", str(data)),
        *("--data.input_key", "prompt"),
        *("--data.output_key", "response"),
        *("--data.max_samples", "16"),  # 4096
        *("--model.model_name_or_path", str(model)),
        *("--ckpt.output_dir", f"{save}/hf"),
        *("--ckpt.path", f"{save}/state"),
        *("--ckpt.save_steps", "2"),  # 50
        *("--logger.logging_steps", "1"),
        *("--eval.dataset", str(eval_data)),
        *("--eval.steps", "2"),  # 20
        *("--train.max_epochs", "1"),
        *("--train.batch_size", "4"),  # 64
        *("--train.micro_batch_size", "2"),
        *("--fsdp.param_dtype", "fp32"),  # bf16: up to 58x slower on a CPU without AVX512_BF16 (docs/platform.md)
        *("--fsdp.attn_implementation", "flash_attention_2"),
        *("--fsdp.tp_size", "1"),
        *("--fsdp.ep_size", "1"),
        *("--fsdp.cp_size", "1"),
        *("--model.gradient_checkpoint", "full"),
        *("--adam.lr", "1e-6"),
        *("--logger.wandb.project", "molt_quickstart_sft_qwen3_4b"),
        *("--logger.wandb.run_name", "qwen3_4b_sft_quickstart_1"),
    ]


def write_rows(path, n: int):
    """Rows shaped like Molt's proRL split: chat messages under `prompt`, the reply under `response`."""
    rows = [
        {"prompt": [{"role": "user", "content": f"What is {i} plus {i + 1}?"}], "response": str(2 * i + 1)}
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_molt_sft_recipe_renders_its_rows_with_the_chat_template_and_others_do_not(caplog):
    args = quick_start_args("m", "d.jsonl", "e.jsonl", "s")
    with caplog.at_level("INFO"):
        cfg = parse_config(clis()["train_sft"], args, "t")
    assert cfg.data.apply_chat_template
    assert "a Molt recipe (--fsdp.attn_implementation): each row is rendered with the chat template" in caplog.text
    # OpenRLHF 0.10's dotted SFT names alone, or a flat name mixed in: openppo's default (no template) stays
    openrlhf = ["--model.model_name_or_path", "m", "--data.dataset", "d.jsonl", "--ds.param_dtype", "fp32"]
    assert not parse_config(clis()["train_sft"], openrlhf, "t").data.apply_chat_template
    assert not parse_config(clis()["train_sft"], [*args, "--seed", "1"], "t").data.apply_chat_template


@pytest.mark.slow
def test_molts_sft_quick_start_runs(tmp_path):
    data = write_rows(tmp_path / "train.jsonl", 16)
    eval_data = write_rows(tmp_path / "eval.jsonl", 4)
    save = tmp_path / "run"
    run_cli("train_sft", quick_start_args(tiny_model_dir(arch="qwen3"), data, eval_data, save), nproc=1)
    records = read_metrics(save / "hf")
    assert [r["step"] for r in records if "eval/loss" in r] == [2, 4], records
    assert (save / "hf" / "model.safetensors").is_file()
