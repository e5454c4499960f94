"""Masked reductions and flag checks shared by the RL math.

Every function in `openppo.algorithms` takes a response mask shaped like the per-token tensor ([B, T]), either
bool or 0/1 float. These helpers turn it into the tensor's dtype so that fp32 stays fp32 and fp64 stays fp64.
Reductions never divide by zero: an all-masked input reduces to 0, not NaN, because a micro-batch whose responses
are all filtered out is a normal event (dynamic filtering, truncation masking) and must not poison the step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def float_mask(mask: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The mask as 0/1 values in `like`'s dtype and device (shape unchanged)."""
    return mask.to(device=like.device, dtype=like.dtype)


def bool_mask(mask: torch.Tensor) -> torch.Tensor:
    """The mask as bool (non-zero means kept)."""
    return mask if mask.dtype == torch.bool else mask != 0


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `x` over kept positions; masked positions are excluded even if they hold inf or NaN.

    Shapes: x, mask [..]; reduction over `dim` (all dims if None).
    """
    kept = torch.where(bool_mask(mask), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `x` over kept positions; 0 where nothing is kept.

    Shapes: x, mask [..]; reduction over `dim` (all dims if None).
    """
    count = float_mask(mask, x)
    count = count.sum() if dim is None else count.sum(dim=dim)
    return masked_sum(x, mask, dim) / count.clamp(min=1)


# The math asserts its invariants with ValueError and the argument's name; the user-facing rules, which name the
# flags, are checked once by the CLIs' validation before anything starts (openppo/ppo/validate.py).


def check_arg(ok: bool, message: str) -> None:
    """Raise ValueError (a caller bug: validation has already rejected bad flags) unless `ok`."""
    if not ok:
        raise ValueError(message)


def check_choice(name: str, value: str, choices: Sequence[str]) -> None:
    """Raise ValueError unless the argument `name` is one of `choices`."""
    check_arg(value in choices, f"{name}={value!r} is not one of {', '.join(choices)}")


def check_same_shape(**tensors: torch.Tensor | None) -> None:
    """Raise ValueError (a caller bug, not a user mistake) unless all given tensors share one shape."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items() if t is not None}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"shape mismatch: {shapes}")
