"""Write `molt-0.1.6.json`: the flags Molt's two CLIs declare and the flags its example scripts pass.

Molt (NVIDIA-NeMo/labs-molt) is OpenRLHF's successor; it keeps OpenRLHF's dotted flag names. Its CLIs build their
parsers under `if __name__ == "__main__":` from blocks in `molt/cli/common_args.py`, some with computed names
(`f"--{prefix}adam.lr"`), so this script runs that parser-building code rather than reading the names off the
source: it executes `common_args.py` (which imports only the standard library) and each CLI's main block up to
`parse_args()`, with a real `argparse.ArgumentParser`, and reads the parser's actions. Nothing else of Molt runs.
Recipes: per `examples/scripts/**/*.sh` that calls `molt.cli.train_rl_ray` or `train_sft`, the flags it passes.

    python tests/assets/molt_flags/extract.py MOLT_GIT_DIR [COMMIT]   # rewrites molt-0.1.6.json beside this file

The CLIs map to openppo's: `train_rl_ray` -> `train_ppo_ray`, `train_sft` -> `train_sft`.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
import types
from pathlib import Path

COMMIT = "2d626085"  # Molt 0.1.6
CLIS = {"molt/cli/train_rl_ray.py": "train_ppo_ray", "molt/cli/train_sft.py": "train_sft"}
OUT = Path(__file__).with_name("molt-0.1.6.json")


def _show(repo: str, commit: str, path: str) -> str:
    return subprocess.run(
        ["git", "--git-dir", repo, "show", f"{commit}:{path}"], check=True, capture_output=True, text=True
    ).stdout


def _files(repo: str, commit: str) -> list[str]:
    out = subprocess.run(
        ["git", "--git-dir", repo, "ls-tree", "-r", "--name-only", commit], check=True, capture_output=True, text=True
    )
    return out.stdout.splitlines()


def _main_block(source: str) -> list[ast.stmt]:
    """The statements of `if __name__ == "__main__":` before the one that calls `parse_args`."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.If) and "__main__" in ast.unparse(node.test):
            body = []
            for stmt in node.body:
                if "parse_args" in ast.unparse(stmt):
                    return body
                body.append(stmt)
    raise SystemExit("no main block that calls parse_args")


def declared(repo: str, commit: str) -> dict[str, dict[str, dict]]:
    common = types.ModuleType("molt.cli.common_args")
    exec(compile(_show(repo, commit, "molt/cli/common_args.py"), "common_args.py", "exec"), common.__dict__)
    sys.modules.update({"molt": types.ModuleType("molt"), "molt.cli": types.ModuleType("molt.cli")})
    sys.modules["molt.cli.common_args"] = common
    flags: dict[str, dict[str, dict]] = {}
    for path, cli in CLIS.items():
        module = ast.Module(body=_main_block(_show(repo, commit, path)), type_ignores=[])
        scope = {"argparse": argparse, "__name__": "__main__"}
        exec(compile(module, path, "exec"), scope)
        parser = scope["parser"]
        entries = {}
        for action in parser._actions:
            for option in action.option_strings:
                if option in ("-h", "--help"):
                    continue
                entry = {"kind": type(action).__name__.lstrip("_").removesuffix("Action").lower() or "store"}
                if action.choices is not None:
                    entry["choices"] = list(action.choices)
                if action.nargs not in (None, 0):
                    entry["nargs"] = action.nargs
                entries[option[2:]] = entry
        flags[cli] = dict(sorted(entries.items()))
    return flags


def recipes(repo: str, commit: str, flags: dict[str, dict[str, dict]]) -> dict[str, dict]:
    """Per script, the Molt flags it passes: the scripts build their arguments in bash arrays and `set --` lines
    around srun, ray and torchrun calls, so the flags are read off the whole script, comments aside: every `--name`
    that is dotted (Molt's own style) or that the script's CLI declares."""
    found = {}
    for path in sorted(p for p in _files(repo, commit) if p.startswith("examples/scripts/") and p.endswith(".sh")):
        text = _show(repo, commit, path)
        clis = [cli for name, cli in (("train_rl_ray", "train_ppo_ray"), ("train_sft", "train_sft")) if name in text]
        if len(clis) != 1:
            continue
        code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
        names = re.findall(r"(?:^|[\s(\"'])--([A-Za-z][\w.-]*)", code)
        passed = [n for n in dict.fromkeys(names) if "." in n or n in flags[clis[0]]]
        found[path] = {"cli": clis[0], "flags": passed}
    return found


def main(argv: list[str]) -> None:
    repo, commit = argv[0], argv[1] if len(argv) > 1 else COMMIT
    flags = declared(repo, commit)
    data = {"molt_commit": commit, "declared": flags, "recipes": recipes(repo, commit, flags)}
    OUT.write_text(json.dumps(data, indent=1) + "\n")
    counts = {cli: len(flags) for cli, flags in data["declared"].items()}
    print(f"{OUT.name}: declared {counts}, {len(data['recipes'])} recipes")


if __name__ == "__main__":
    main(sys.argv[1:])
