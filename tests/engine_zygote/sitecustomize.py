"""Python imports this at start-up in every process of the test session's Ray cluster, whose PYTHONPATH leads with
this folder (tests/ray_cluster.py): it loads `openppo_test_engine_zygote`, then the `sitecustomize` it shadows, if
any (Debian's Python has one)."""

import importlib.machinery
import importlib.util
import os
import sys

import openppo_test_engine_zygote  # noqa: F401

_here = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [p for p in sys.path if os.path.abspath(p or os.curdir) != _here]
)
if _spec is not None and _spec.loader is not None:
    _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
