"""Bad input: one line on stderr naming the flag, exit code 2, nothing written to --save_path.

The CLIs validate before starting a process group, so they run in-process here (fast).
"""

from __future__ import annotations

import importlib

import pytest

from tests.cli.data import preference_rows, sft_rows
from tests.cli.helpers import write_jsonl
from tests.model_cache import tiny_model_dir


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad")
    return {"sft": write_jsonl(tmp / "sft.jsonl", sft_rows(8)), "pairs": write_jsonl(tmp / "p.jsonl", preference_rows(8)),
            "empty": write_jsonl(tmp / "empty.jsonl", []), "model": tiny_model_dir()}


CASES = [
    # (cli, args (with {sft} {pairs} {model} {empty} placeholders), flag expected in the message)
    ("train_sft", ["--dataset", "/nonexistent/data.jsonl"], "--dataset"),
    ("train_sft", ["--input_key", "question"], "--input_key"),
    ("train_sft", ["--output_key", "answer"], "--output_key"),
    ("train_sft", ["--pretrain", "/nonexistent/model"], "--pretrain"),
    ("train_sft", ["--zero_stage", "4"], "--zero_stage"),
    ("train_sft", ["--param_dtype", "fp16"], "--param_dtype"),
    ("train_sft", ["--train_batch_size", "6", "--micro_train_batch_size", "4"], "--train_batch_size"),
    ("train_sft", ["--dataset", "{empty}"], "--dataset"),
    ("train_sft", ["--max_len", "-5"], "--max_len"),
    ("train_sft", ["--multiturn", "--apply_chat_template_off"], "--multiturn"),
    ("train_sft", ["--input_template", "no placeholder", "--apply_chat_template_off"], "--input_template"),
    ("train_rm", ["--chosen_key", "good"], "--chosen_key"),
    ("train_rm", ["--loss", "hinge"], "--loss"),
    ("train_dpo", ["--ref_pretrain", "/nonexistent/ref"], "--ref_pretrain"),
    ("train_dpo", ["--beta", "0"], "--beta"),
    ("lora_combiner", ["--lora_path", "/nonexistent/adapter"], "--lora_path"),
]


def _base(cli, files, save):
    if cli == "train_sft":
        return ["--pretrain", str(files["model"]), "--dataset", str(files["sft"]), "--apply_chat_template",
                "--train_batch_size", "4", "--micro_train_batch_size", "2", "--save_path", str(save)]
    if cli in ("train_rm", "train_dpo"):
        return ["--pretrain", str(files["model"]), "--dataset", str(files["pairs"]), "--prompt_key", "prompt",
                "--apply_chat_template", "--train_batch_size", "4", "--micro_train_batch_size", "2",
                "--save_path", str(save)]
    return ["--model_path", str(files["model"]), "--output_path", str(save)]


def _merge(base: list[str], extra: list[str]) -> list[str]:
    """Later flags override earlier ones; a flag ending in _off removes that flag from the base."""
    out = list(base)
    for flag in [e for e in extra if e.startswith("--") and e.endswith("_off")]:
        out = [a for a in out if a != flag[: -len("_off")]]
    return out + [e for e in extra if not e.endswith("_off")]


@pytest.mark.parametrize("cli,args,flag", CASES, ids=[f"{c}{a[0]}" for c, a, _ in CASES])
def test_bad_input_one_line_error(cli, args, flag, files, tmp_path, capsys):
    save = tmp_path / "save"
    argv = _merge(_base(cli, files, save), [a.format(**{k: str(v) for k, v in files.items()}) for a in args])
    module = importlib.import_module(f"openppo.cli.{cli}")
    try:
        code = module.main(argv)
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("error:") and flag in lines[0], err
    assert not save.exists(), "nothing may be written on bad input"
