"""Masked reductions of per-token tensors, and the exact reduction of a per-token loss to one optimizer step.

Masks. Every function in `openppo.algorithms` takes a response mask shaped like the per-token tensor ([B, T]),
either bool or 0/1 float. These helpers turn it into the tensor's dtype so that fp32 stays fp32 and fp64 stays
fp64. Reductions never divide by zero: an all-masked input reduces to 0, not NaN, because a micro-batch whose
responses are all filtered out is a normal event (dynamic filtering, truncation masking) and must not poison the
step.

Loss aggregation. An optimizer step sees G gradient-accumulation micro-batches on each of D data-parallel ranks.
The loss we want is one reduction over all of them (e.g. one mean over every response token of the step), not a
mean of per-micro-batch means, which would weigh a token of a short micro-batch more than a token of a long one. So
`aggregate_loss` returns a micro-batch's *contribution*: its share of the numerator over the *global* normaliser.
Summing the contributions of all micro-batches on all ranks gives the exact global value.

The caller computes the global normalisers before the first micro-batch: sum `loss_normalizers(mask)` over the
micro-batches of the step on its rank, then all-reduce (sum) over the data-parallel group.

DeepSpeed: `engine.backward(loss)` divides the loss by G, and the gradient all-reduce averages over the D ranks,
so the gradient DeepSpeed applies is (1 / (D * G)) * sum of contribution gradients. To apply the gradient of the
global loss, backpropagate `contribution * D * G`, and log the plain contribution (summed over micro-batches and
ranks). Without DeepSpeed (plain accumulation of `.backward()` and a summing all-reduce) use the contribution as is.
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


# -- one optimizer step's loss ------------------------------------------------------------------------------------


LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def loss_normalizers(mask: torch.Tensor) -> torch.Tensor:
    """Local (num_tokens, num_seqs) of a micro-batch as an int64 tensor [2], ready for a summing all-reduce.

    num_seqs counts sequences with at least one kept token: a fully masked response (filtered, or truncated and
    masked) is not a sample of the step, in every mode.
    """
    keep = bool_mask(mask)
    return torch.stack([keep.sum(), keep.any(dim=-1).sum()]).to(torch.int64)


def aggregate_loss(
    per_token_loss: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "token-mean",
    *,
    num_tokens_global: float | torch.Tensor | None = None,
    num_seqs_global: float | torch.Tensor | None = None,
    norm_len: int | None = None,
) -> torch.Tensor:
    """This micro-batch's contribution to the step loss (`--loss_agg_mode`; defaults per estimator in
    `estimators.default_loss_agg_mode`). Shapes: per_token_loss, mask [B, T] -> scalar; gradient flows to the loss.

    Let S_i = sum_t m_it * l_it and n_i = sum_t m_it; N = num_tokens_global, M = num_seqs_global (over every
    micro-batch and rank of the step; each falls back to this micro-batch's own count when None).

        token-mean               sum_i S_i / N                 DAPO, arXiv:2503.14476; verl/TRL "token-mean"/"dapo"
        seq-mean-token-mean      sum_i (S_i / n_i) / M         original GRPO, arXiv:2402.03300; GSPO
        seq-mean-token-sum       sum_i S_i / M                 verl "seq-mean-token-sum": each response's summed
                                                               loss, averaged over responses
        seq-mean-token-sum-norm  sum_i S_i / (M * norm_len)    Dr. GRPO, arXiv:2503.20783: a constant
                                                               normaliser per response (norm_len = max_new_tokens)

    Sequences with n_i = 0 contribute nothing and are not counted in M (see `loss_normalizers`).
    """
    check_choice("mode", mode, LOSS_AGG_MODES)
    check_same_shape(per_token_loss=per_token_loss, mask=mask)
    if mode == "token-mean":
        if num_tokens_global is None:
            num_tokens_global = bool_mask(mask).sum()
        return masked_sum(per_token_loss, mask) / _positive(num_tokens_global, per_token_loss)
    if num_seqs_global is None:
        num_seqs_global = bool_mask(mask).any(dim=-1).sum()
    num_seqs = _positive(num_seqs_global, per_token_loss)
    if mode == "seq-mean-token-mean":
        seq_sums = masked_sum(per_token_loss, mask, dim=-1)
        seq_lens = float_mask(mask, per_token_loss).sum(dim=-1).clamp(min=1)
        return (seq_sums / seq_lens).sum() / num_seqs
    if mode == "seq-mean-token-sum":
        return masked_sum(per_token_loss, mask) / num_seqs
    if norm_len is None or norm_len <= 0:
        raise ValueError(f"aggregate_loss: seq-mean-token-sum-norm needs norm_len > 0 (max_new_tokens), got {norm_len}")
    return masked_sum(per_token_loss, mask) / (num_seqs * norm_len)


def _positive(count: float | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A normaliser as a tensor of `like`'s dtype and device, at least 1 (an empty step gives loss 0, not NaN)."""
    return torch.as_tensor(count, device=like.device).to(like.dtype).clamp(min=1)
