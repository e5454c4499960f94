"""Write `recipes.json`: the command line of every training recipe OpenRLHF ships (v0.9.10 and v0.11.0).

Each `examples/scripts/train_*.sh` of a tag (the SLURM ones aside: they wrap the same commands in `srun`) runs under
bash with `python`, `python3`, `ray`, `deepspeed` and `torchrun` replaced by a shim that records its argv and exits
0 (the shims of tests/cli/test_recipes.py), so bash expands the scripts' variables and arrays itself. The recorded
`openrlhf.cli.<name>` commands are kept as (CLI, arguments); model and data paths stay as the scripts give them and
tests/ppo/test_openrlhf_recipes.py replaces them.

    python tests/assets/openrlhf_flags/extract_recipes.py OPENRLHF_GIT_DIR   # rewrites recipes.json beside this file
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

TAGS = ("v0.9.10", "v0.11.0")
OUT = Path(__file__).with_name("recipes.json")
SHIMMED = ("python", "python3", "ray", "deepspeed", "torchrun")
SHIM = '#!{bash}\nf=$(mktemp "$RECIPE_CALLS/call.XXXXXX")\nprintf \'%s\\0\' "${{0##*/}}" "$@" > "$f"\nexit 0\n'


def _git(repo: str, *args: str) -> str:
    return subprocess.run(["git", "--git-dir", repo, *args], check=True, capture_output=True, text=True).stdout


def _command(argv: list[str]) -> tuple[str, list[str]] | None:
    """(CLI name, arguments) of a recorded `python -m openrlhf.cli.X`, `deepspeed --module`, `ray job submit -- ...`."""
    if argv[0] == "ray":
        return _command(argv[argv.index("--") + 1 :]) if "--" in argv else None
    for i, arg in enumerate(argv[1:-1], 1):
        if arg in ("-m", "--module") and argv[i + 1].startswith("openrlhf.cli."):
            return argv[i + 1].removeprefix("openrlhf.cli."), argv[i + 2 :]
    return None


def extract(repo: str) -> dict:
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        shims = Path(tmp) / "bin"
        shims.mkdir()
        for name in SHIMMED:
            (shims / name).write_text(SHIM.format(bash=shutil.which("bash")))
            (shims / name).chmod(0o755)
        for tag in TAGS:
            out[tag] = {}
            scripts = [p for p in _git(repo, "ls-tree", "--name-only", tag, "examples/scripts/").split() if p]
            for path in sorted(scripts):
                name = Path(path).name
                if not name.startswith("train_") or "slurm" in name:
                    continue
                script, calls = Path(tmp) / name, Path(tempfile.mkdtemp(dir=tmp))
                script.write_text(_git(repo, "show", f"{tag}:{path}"))
                env = {"PATH": f"{shims}{os.pathsep}{os.environ['PATH']}", "HOME": tmp, "RECIPE_CALLS": str(calls)}
                subprocess.run(["bash", str(script)], env=env, cwd=tmp, capture_output=True, timeout=60, check=True)
                for call in sorted(calls.iterdir()):
                    command = _command(call.read_bytes().decode().split("\0")[:-1])
                    if command is not None:
                        out[tag][name] = {"cli": command[0], "args": command[1]}
    return out


if __name__ == "__main__":
    OUT.write_text(json.dumps(extract(sys.argv[1]), indent=1) + "\n")
    print(f"wrote {OUT}")
