"""Every `from openppo|bench|tests.X import Y` in the repository names something that exists, lazy imports included.

A name that moved leaves the imports inside functions broken until they run: the benches import inside `main`, and
no test runs most of them, so `bench/train_step_mfu.py` importing `free_port` from where it no longer was stopped
every run of the GPU table at start, found only on a GPU. The check imports each module the code names, in a
process of its own (some pull in vLLM or DeepSpeed), and looks the names up.
"""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("openppo", "bench", "tests", "examples")
OWN = {"openppo", "bench", "tests"}


def project_imports() -> dict[str, set[tuple[str, str]]]:
    """module -> {(imported name, importing file)} for every absolute `from <project module> import ...`."""
    found: dict[str, set[tuple[str, str]]] = {}
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    if node.module.split(".")[0] in OWN:
                        for alias in node.names:
                            found.setdefault(node.module, set()).add((alias.name, str(path.relative_to(REPO))))
    return found


def unresolved() -> list[str]:
    """The imports whose module fails to import or lacks the name (neither an attribute nor a submodule)."""
    bad = []
    for module, names in sorted(project_imports().items()):
        try:
            imported = importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 (any failure to import is the finding)
            bad.append(f"{module}: {type(exc).__name__}: {exc}")
            continue
        for name, where in sorted(names):
            if name == "*" or hasattr(imported, name):
                continue
            try:
                importlib.import_module(f"{module}.{name}")
            except ImportError:
                bad.append(f"{where}: from {module} import {name}")
    return bad


def test_every_project_import_resolves():
    proc = subprocess.run(
        [sys.executable, __file__], cwd=REPO, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


def test_a_moved_name_is_found(tmp_path, monkeypatch):
    """The check itself: a lazy import of a name its module lacks is reported."""
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "b.py").write_text("def main():\n    from tests.spawn import no_such_name\n")
    monkeypatch.setattr(sys.modules[__name__], "REPO", tmp_path)
    monkeypatch.setattr(sys.modules[__name__], "ROOTS", ("bench",))
    monkeypatch.syspath_prepend(str(REPO))
    assert unresolved() == ["bench/b.py: from tests.spawn import no_such_name"]


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    problems = unresolved()
    print("\n".join(problems) or "every project import resolves")
    sys.exit(1 if problems else 0)
