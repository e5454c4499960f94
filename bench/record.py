"""What every bench shares: its precision option (auto by default, as in training) and the JSON record it prints
last, which names the device (CPU model and PyTorch's CPU capability, or the GPU), so that figures from different
machines are never compared unknowingly."""

from __future__ import annotations

import argparse
import json


def add_dtype_option(parser: argparse.ArgumentParser, what: str = "training precision") -> None:
    parser.add_argument(
        "--dtype",
        choices=("auto", "bf16", "fp32"),
        default="auto",
        help=f"{what}; auto = bf16 where the device runs it fast, else fp32 (as --param_dtype auto)",
    )


def resolve_dtype(value: str) -> str:
    """bf16 or fp32: `auto` resolved for this machine."""
    from openppo.utils.hardware import auto_param_dtype

    return auto_param_dtype() if value == "auto" else value


def emit(record: dict, prefix: str = "") -> None:
    """Print the bench's record as one JSON line, with the device it ran on."""
    from openppo.utils.hardware import device_record

    print(prefix + json.dumps({**record, "device": device_record()}))


def timing_engine(strategy, model):
    """A training engine for timing updates: AdamW at lr 1e-7 on a constant schedule, so that the steps a bench
    times barely move the weights and every variant it compares computes with (nearly) the same ones."""
    return strategy.prepare_train(
        model,
        lr=1e-7,
        betas=(0.9, 0.95),
        weight_decay=0.0,
        scheduler="constant",
        warmup_ratio=0.0,
        min_lr_ratio=0.1,
        num_training_steps=1000,
    )
