"""Reducing a per-token loss [B, T] to the scalar of one optimizer step, exactly, across micro-batches and ranks.

An optimizer step sees G gradient-accumulation micro-batches on each of D data-parallel ranks. The loss we want is
one reduction over all of them (e.g. one mean over every response token of the step), not a mean of per-micro-batch
means, which would weigh a token of a short micro-batch more than a token of a long one. So `aggregate_loss`
returns a micro-batch's *contribution*: its share of the numerator over the *global* normaliser. Summing the
contributions of all micro-batches on all ranks gives the exact global value.

The caller computes the global normalisers before the first micro-batch: sum `loss_normalizers(mask)` over the
micro-batches of the step on its rank, then all-reduce (sum) over the data-parallel group.

DeepSpeed: `engine.backward(loss)` divides the loss by G, and the gradient all-reduce averages over the D ranks,
so the gradient DeepSpeed applies is (1 / (D * G)) * sum of contribution gradients. To apply the gradient of the
global loss, backpropagate `contribution * D * G`, and log the plain contribution (summed over micro-batches and
ranks). Without DeepSpeed (plain accumulation of `.backward()` and a summing all-reduce) use the contribution as is.
"""

from __future__ import annotations

import torch

from openppo.algorithms.masking import bool_mask, check_choice, check_same_shape, float_mask, masked_sum

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
