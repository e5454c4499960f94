"""TORCH_CUDA_ARCH_LIST with architecture-specific entries ("9.0a", set by CUDA images for Hopper) stops DeepSpeed's
JIT build of FusedAdam, so every GPU run with ZeRO would fail at its first optimizer. openppo rewrites the variable
to entries DeepSpeed parses. The check runs DeepSpeed's own CUDA op builder parser, which needs no GPU."""

from __future__ import annotations

import importlib
import os

import pytest

from openppo.strategy.deepspeed_strategy import deepspeed_arch_list, readable_cuda_arch_list


@pytest.mark.parametrize(
    "value,expected",
    [
        ("9.0a", "9.0"),
        ("8.0;9.0a+PTX", "8.0;9.0+PTX"),
        ("8.6 9.0 9.0a 10.0f", "8.6;9.0;10.0"),
        ("7.5+PTX", "7.5+PTX"),
    ],
)
def test_arch_specific_entries_lose_their_suffix(value, expected):
    assert deepspeed_arch_list(value) == expected


def _parse() -> None:
    """DeepSpeed's FusedAdam builder reading TORCH_CUDA_ARCH_LIST as in a JIT build."""
    builder = importlib.import_module("deepspeed.ops.op_builder.fused_adam").FusedAdamBuilder()
    builder.jit_mode = True
    builder.compute_capability_args()


def test_deepspeed_builds_after_the_rewrite(monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0a+PTX")
    with pytest.raises(ValueError, match="0a"):  # the failure seen on an H200 image
        _parse()
    readable_cuda_arch_list()

    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0+PTX"
    _parse()


def test_a_readable_list_is_left_alone(monkeypatch):
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0;9.0+PTX")
    readable_cuda_arch_list()

    assert os.environ["TORCH_CUDA_ARCH_LIST"] == "8.0;9.0+PTX"
