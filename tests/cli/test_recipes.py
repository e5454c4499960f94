"""Every recipe in examples/scripts/ passes flags its CLI accepts (fast; nothing is trained or launched).

Each script runs under real bash, so `$VAR` / `${VAR:-default}` expansion, quoting and line continuations are
bash's own, but with `python`, `python3`, `ray`, `deepspeed` and `torchrun` replaced by a shim (first on PATH)
that records its argv and exits 0. Each recorded `openppo.cli.*` command is then parsed by the parser its CLI
builds from its config, with prefix abbreviations off (argparse would otherwise accept `--eval_step` for
`--eval_steps`). Validation is not run: it checks that model and data paths exist.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from openppo.cli.flags_doc import clis
from openppo.cli.models import build_parser as models_parser
from openppo.config.schema import build_parser, parse_config

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((REPO / "examples" / "scripts").glob("*.sh"))
# recipes spelled in both OpenRLHF flag generations: SPELLING=flat (<= 0.9) or SPELLING=dotted (>= 0.10)
BOTH_SPELLINGS = [s for s in SCRIPTS if "SPELLING" in s.read_text()]
BASH = shutil.which("bash")
SHIMMED = ("python", "python3", "ray", "deepspeed", "torchrun")
# The shim writes one file per call: its name, then its arguments, NUL-separated. A recipe that waits for
# serve_rm's ready line on its stdout gets that line, written after the record, so the wait always sees the record.
SHIM = """#!{bash}
f=$(mktemp "$RECIPE_CALLS/call.XXXXXX")
printf '%s\\0' "${{0##*/}}" "$@" > "$f"
case " $* " in *" openppo.cli.serve_rm "*) echo "serving rewards on http://127.0.0.1:5000/get_reward";; esac
exit 0
"""


@pytest.fixture(scope="module")
def shim_dir(tmp_path_factory) -> Path:
    bin_dir = tmp_path_factory.mktemp("shims")
    for name in SHIMMED:
        path = bin_dir / name
        path.write_text(SHIM.format(bash=BASH))
        path.chmod(0o755)
    return bin_dir


def record_calls(script: Path, shim_dir: Path, tmp: Path, extra_env: dict[str, str] | None = None) -> list[list[str]]:
    """Run `script` with the shims first on PATH; the argv of every shimmed command it ran."""
    calls = Path(tempfile.mkdtemp(prefix="calls", dir=tmp))
    # A small fixed environment: the scripts' own defaults apply, except outputs, which go under tmp.
    env = {
        "PATH": f"{shim_dir}{os.pathsep}{os.environ['PATH']}",
        "HOME": str(tmp),
        "LC_ALL": "C",
        "RECIPE_CALLS": str(calls),
        "PY": "python",
        "OUT": str(tmp / "out"),
        "SAVE": str(tmp / "save"),
        "DATA_DIR": str(tmp / "data"),
        "SHARED": str(tmp / "shared"),
        **(extra_env or {}),
    }
    proc = subprocess.run([BASH, str(script)], env=env, cwd=tmp, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"{script.name} exited {proc.returncode} under the shims:\n{proc.stderr[-3000:]}"
    return [f.read_bytes().decode().split("\0")[:-1] for f in sorted(calls.iterdir())]


def cli_command(argv: list[str]) -> tuple[str, list[str]] | None:
    """`(module, args)` of a recorded `python -m M`, `torchrun ... -m M`, `deepspeed ... --module M` or
    `ray job submit ... -- <one of those>`; None for anything else."""
    prog, args = argv[0], argv[1:]
    if prog == "ray":
        if args[:2] != ["job", "submit"] or "--" not in args:
            return None
        return cli_command(args[args.index("--") + 1 :])
    for i, arg in enumerate(args[:-1]):
        if arg in ("-m", "--module"):
            return args[i + 1], args[i + 2 :]
    return None


def _no_abbreviations(parser: argparse.ArgumentParser) -> None:
    parser.allow_abbrev = False  # read at parse time, so setting it after construction works
    for action in parser._actions:  # subcommands (openppo.cli.models) have parsers of their own
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _no_abbreviations(sub)


def parse_error(module: str, args: list[str]) -> str | None:
    """The one-line error the CLI `module` gives for `args` at parse time, or None when they parse."""
    name = module.removeprefix("openppo.cli.")
    configs = clis()
    if name in configs:
        parser = build_parser(configs[name], module, "")
    elif name == "models":
        parser = models_parser()
    else:
        return f"no parser known for {module}: add its config to openppo.cli.flags_doc.clis()"
    _no_abbreviations(parser)
    flags = [a.split("=", 1)[0] for a in args if a.startswith("--")]
    repeated = sorted({f for f in flags if flags.count(f) > 1})
    if repeated:
        return f"{', '.join(repeated)} given more than once (argparse keeps the last one silently)"
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            parser.parse_args(args)
            if name in configs:
                parse_config(configs[name], args, module)  # builds the config exactly as the CLI does
    except SystemExit:
        return stderr.getvalue().strip() or "argparse exited without a message"
    return None


def test_every_recipe_is_collected():
    names = {s.name for s in SCRIPTS}
    assert {
        "demo_cpu.sh",
        "train_sft.sh",
        "train_ppo_hybrid_engine.sh",
        "train_grpo_reward_func.sh",
        "train_reinforce_baseline.sh",
        "train_ppo_multinode.sh",
    } <= names, sorted(names)


def test_every_recipe_is_in_the_readme():
    readme = (REPO / "README.md").read_text()
    missing = [s.name for s in SCRIPTS if f"examples/scripts/{s.name}" not in readme]
    assert not missing, f"add these recipes to the Recipes table in README.md: {missing}"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s.name)
def test_recipe_is_an_executable_bash_script(script):
    assert os.access(script, os.X_OK), f"{script.name} is not executable: chmod +x {script}"
    assert script.read_text().startswith("#!/usr/bin/env bash\n"), f"{script.name}: first line is not the shebang"
    proc = subprocess.run([BASH, "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, f"{script.name}: bash -n: {proc.stderr}"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: s.name)
def test_recipe_flags_parse(script, shim_dir, tmp_path):
    calls = record_calls(script, shim_dir, tmp_path)
    commands = []
    for argv in calls:
        command = cli_command(argv)
        assert command is not None and command[0].startswith("openppo.cli."), (
            f"{script.name} runs `{' '.join(argv)}`, which is not an openppo.cli command this test can check"
        )
        commands.append(command)
    assert commands, f"{script.name} ran no python -m openppo.cli.* command"
    for module, args in commands:
        error = parse_error(module, args)
        assert error is None, f"{script.name}: {module}: {error}"


def test_shim_sees_what_bash_expands(shim_dir, tmp_path):
    script = tmp_path / "recipe.sh"
    script.write_text(
        "set -euo pipefail\nMODEL=${MODEL:-models/a b}\nSAVE=${SAVE:-runs/x}\n"
        "ray job submit --address http://h:8265 -- python -m openppo.cli.train_ppo_ray \\\n"
        '   --pretrain "$MODEL" \\\n   --save_path "$SAVE/out" --eps_clip_low_high 0.2 0.28\n'
    )
    calls = record_calls(script, shim_dir, tmp_path)
    assert calls == [
        [
            "ray",
            "job",
            "submit",
            "--address",
            "http://h:8265",
            "--",
            "python",
            "-m",
            "openppo.cli.train_ppo_ray",
            "--pretrain",
            "models/a b",
            "--save_path",
            f"{tmp_path / 'save'}/out",
            "--eps_clip_low_high",
            "0.2",
            "0.28",
        ]
    ]
    assert cli_command(calls[0]) == ("openppo.cli.train_ppo_ray", calls[0][9:])
    assert parse_error(*cli_command(calls[0])) is None


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--no_such_flag", "1"], "--no_such_flag"),
        (["--advantage_estimator", "grpo"], "--advantage_estimator"),
        (["--eval_step", "5"], "--eval_step"),  # an abbreviation of --eval_steps
        (["--eps_clip_low_high", "0.2"], "--eps_clip_low_high"),  # needs two numbers
        (["--seed", "1", "--seed", "2"], "--seed given more than once"),
    ],
)
def test_parse_error_names_the_flag(args, expected):
    error = parse_error("openppo.cli.train_ppo_ray", args)
    assert error is not None and expected in error, error


def test_the_main_recipes_come_in_both_spellings():
    assert {
        "train_grpo_reward_func.sh",
        "train_ppo_hybrid_engine.sh",
        "train_sft.sh",
        "train_rm.sh",
        "train_dpo.sh",
    } <= {s.name for s in BOTH_SPELLINGS}


@pytest.mark.parametrize("script", BOTH_SPELLINGS, ids=lambda s: s.name)
def test_both_spellings_of_a_recipe_parse_to_one_config(script, shim_dir, tmp_path):
    configs = {}
    for spelling in ("flat", "dotted"):
        commands = [cli_command(c) for c in record_calls(script, shim_dir, tmp_path, {"SPELLING": spelling})]
        for module, args in commands:
            error = parse_error(module, args)
            assert error is None, f"{script.name} (SPELLING={spelling}): {module}: {error}"
        parsed = [parse_config(clis()[module.removeprefix("openppo.cli.")], args, module) for module, args in commands]
        configs[spelling] = sorted(parsed, key=repr)  # the shim records calls in no particular order
    assert configs["flat"] == configs["dotted"], script.name
    dotted = [a for _, args in commands for a in args if a.startswith("--") and "." in a.split("=")[0]]
    assert len(dotted) >= 10, f"{script.name}: SPELLING=dotted passes only {dotted}"
