"""Imports between openppo's packages go one way: down the layers below, never up or sideways into a cycle.

Every `import openppo.X` and `from openppo.X import ...` counts, at module level or inside a function (a lazy import
is still a dependency; it only hides a cycle until the code runs).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import openppo

PACKAGE = Path(openppo.__file__).parent
# A package may import the packages of lower layers only (and itself).
LAYERS = [
    {"errors"},
    {"utils"},
    {"config", "algorithms"},  # typed config; pure RL math (no ray / deepspeed / vllm)
    {"models", "datasets", "distributed", "tasks"},
    {"strategy", "rewards", "rollout"},
    {"agents", "trainers"},
    {"ppo"},
    {"cli"},
]
LAYER = {name: i for i, names in enumerate(LAYERS) for name in names}


def _package_imports(root: Path = PACKAGE) -> dict[str, set[tuple[str, str]]]:
    """package -> {(imported package, the importing file)} over every module under `root` (the openppo package)."""
    edges: dict[str, set[tuple[str, str]]] = defaultdict(set)
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if len(rel.parts) == 1:  # openppo/__init__.py and top-level modules
            source = rel.stem
        else:
            source = rel.parts[0]
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                parts = name.split(".")
                if parts[0] == "openppo" and len(parts) > 1 and parts[1] != source:
                    edges[source].add((parts[1], str(rel)))
    return edges


def test_every_package_has_a_layer():
    names = {p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    names |= {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    assert names <= set(LAYER), f"add these to LAYERS: {sorted(names - set(LAYER))}"


def _upward(edges: dict[str, set[tuple[str, str]]]) -> list[str]:
    return sorted(
        f"{source} -> {target} ({where})"
        for source, targets in edges.items()
        for target, where in targets
        if LAYER[target] >= LAYER[source]
    )


def test_imports_only_go_down_the_layers():
    upward = _upward(_package_imports())
    assert not upward, "imports up or across the layers:\n" + "\n".join(upward)


def test_the_scan_sees_lazy_and_upward_imports(tmp_path):
    """A function-level import from rollout up into ppo, in a package laid out like openppo's, is reported."""
    for package in ("rollout", "ppo"):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "ppo" / "trainer.py").write_text("from openppo.rollout.pool import EnginePool\n")
    (tmp_path / "rollout" / "pool.py").write_text("def f():\n    from openppo.ppo import trainer\n")
    assert _upward(_package_imports(tmp_path)) == [f"rollout -> ppo ({Path('rollout') / 'pool.py'})"]
