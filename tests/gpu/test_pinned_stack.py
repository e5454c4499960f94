"""The GPU machine's packages against requirements/gpu.txt: every pinned package that is installed imports (a
flash-attn or DeepSpeed built against another torch fails here, at import, with undefined symbols), and the versions
that differ from the pins are listed. A lent check machine comes with its own torch and lacks vLLM and Ray, so a
difference is reported, not failed; on a machine set up with `make install-gpu` the list is empty."""

from __future__ import annotations

import importlib
import importlib.util

import pytest

from openppo.utils.pins import installed_mismatches, read_pins
from tests.conftest import REPO
from tests.gpu.conftest import requires_cuda

pytestmark = [pytest.mark.gpu, requires_cuda]
MODULES = {
    "torch": "torch",
    "vllm": "vllm",
    "deepspeed": "deepspeed",
    "ray": "ray",
    "transformers": "transformers",
    "peft": "peft",
    "datasets": "datasets",
    "flash-attn": "flash_attn",
}


def test_the_pinned_packages_that_are_installed_import():
    pins = read_pins(REPO / "requirements" / "gpu.txt")
    assert set(MODULES) <= set(pins)
    missing = sorted(name for name, module in MODULES.items() if importlib.util.find_spec(module) is None)
    for name, module in MODULES.items():
        if name not in missing:
            importlib.import_module(module)
    print(f"not installed (not checked): {', '.join(missing) or 'none'}")
    print(f"installed at other versions than pinned (pin, installed): {installed_mismatches(pins) or 'none'}")
