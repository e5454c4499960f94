"""The rollout engine's sampling distribution, recomputed by the trainer: top-k and top-p truncation.

With `--top_k` or `--top_p < 1` the engine samples from a truncated, renormalised softmax and reports the
log-probs of that distribution (vLLM's `processed_logprobs`). The trainer's policy is the plain softmax of
logits / T. To compare the two sides (importance weights of `--enable_vllm_is_correction` and `--async_train`,
`rollout/logprob_diff`) the trainer scores the sampled tokens under the same truncation, applied to its own logits:

    z      = logits / T
    top-k: keep the tokens whose z is >= the k-th largest z (ties kept)
    top-p: sort the kept tokens by z ascending, p_i = softmax; drop the prefix whose cumulative sum is <= 1 - top_p
           (the largest token is always kept)
    log q(a) = z_a - logsumexp(z over the kept tokens),   -inf when a was not kept

This is vLLM's rule (`apply_top_k_top_p`: top-k first, then top-p on the top-k distribution), except for exact ties
at the top-p cut: here every token equal to the first kept value is kept, while vLLM cuts by position in its sort,
so it may drop some of them (which ones depends on the sort). The trainer's kept set then holds those tokens too,
and its log-probs are lower by their share (`rollout/logprob_diff` shows it); logits of a trained model are exactly
equal only by chance. A token the engine sampled can fall outside the trainer's kept set: at the boundary through
rounding, or because the policy moved (a stale batch). Its probability under the trainer's truncated policy is then
0, and -inf says so; `engine_gap` counts such tokens (`rollout/outside_support`). The importance weights
(`losses.importance_weights`) clamp the log-ratio to -20, so its ratio is e^-20, which each correction treats as it
treats any ratio below the band's low end (`--vllm_is_truncated_threshold`, 0.5 by default):
    tis           weight = low: truncated IS clips every ratio into [low, high], as OpenRLHF defines it;
    icepop        weight 0: the token is dropped, as is every token whose ratio leaves the band;
    seq-mask-tis  weight = low, unless the response's geometric-mean ratio leaves the band, then 0.
`tis` keeps the token at the floor weight rather than 0 because the floor is its rule for every token the trainer
finds less likely than the engine did, and a boundary token lost to rounding belongs there; use `icepop` to drop
tokens outside the trainer's support.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from openppo.algorithms.reductions import check_arg

# positions per chunk: a sort of chunk x V values (plus int64 indices) is the extra memory, ~60 MB at V = 150k
_CHUNK_ROWS = 64


@dataclass(frozen=True)
class SamplingFilter:
    """The truncation the engine applies after dividing by the temperature; -1 / 1.0 switch a part off."""

    top_k: int = -1
    top_p: float = 1.0

    def __post_init__(self):
        check_arg(self.top_k == -1 or self.top_k >= 1, f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        check_arg(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def active(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0


def _kept(z: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """[N, V] temperature-scaled logits -> the same with -inf on the tokens the filter drops."""
    vocab = z.size(-1)
    ascending = None
    if 0 < top_k < vocab:
        largest = z.topk(top_k, dim=-1).values
        kth = largest[:, -1:]
        z = z.masked_fill(z < kth, float("-inf"))
        # top-p then needs only the kept values in order: the top-k ones, unless a tie at the k-th value keeps more
        # (sorting k values instead of V: 3.0 s a step of the e2e GRPO run with --top_k 1000 on a 49k vocabulary)
        if top_p < 1.0 and not bool(((z > float("-inf")).sum(dim=-1) > top_k).any()):
            ascending = largest.flip(-1)
    if top_p < 1.0:
        if ascending is None:
            ascending = z.sort(dim=-1).values
        cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
        dropped = cumulative <= 1.0 - top_p
        dropped[:, -1] = False
        # the cumulative sum only grows, so the dropped tokens are a prefix: the first kept value is the threshold
        threshold = ascending.gather(1, dropped.sum(dim=-1, keepdim=True))
        z = z.masked_fill(z < threshold, float("-inf"))
    return z


@torch.no_grad()
def sampling_log_probs(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float, sampling: SamplingFilter
) -> torch.Tensor:
    """log q(label) under the engine's sampling distribution (see the module docstring); no gradient.

    Shapes: logits [..., V], labels [...] -> [...] fp32 (fp64 for fp64 logits). Walks the positions in chunks of
    64, so the extra memory is one chunk's sort whatever the batch is.
    """
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    flat_logits = logits.reshape(-1, logits.size(-1))
    flat_labels = labels.reshape(-1).long()
    out = torch.empty(flat_labels.shape, dtype=dtype, device=logits.device)
    for start in range(0, flat_labels.numel(), _CHUNK_ROWS):
        rows = slice(start, start + _CHUNK_ROWS)
        z = flat_logits[rows].to(dtype) / temperature
        label = flat_labels[rows].unsqueeze(1)
        z_label = z.gather(1, label).squeeze(1)
        kept = _kept(z, sampling.top_k, sampling.top_p) if sampling.active else z
        inside = kept.gather(1, label).squeeze(1) > float("-inf")
        out[rows] = torch.where(inside, z_label - kept.logsumexp(dim=-1), float("-inf"))
    return out.reshape(labels.shape)


def engine_gap(
    rollout_log_probs: torch.Tensor, comparable_log_probs: torch.Tensor, mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """How far the engine's log-probs are from the trainer's under the same distribution, over the masked tokens:
    `logprob_diff`, the mean |difference| over the tokens inside the trainer's support, `logprob_diff_max` the
    largest, and `outside_support`, the share of tokens the engine sampled that the trainer's truncation excludes
    (log-prob -inf)."""
    keep = mask.bool()
    outside = torch.isneginf(comparable_log_probs) & keep
    inside = keep & ~outside
    diff = torch.where(inside, (rollout_log_probs - comparable_log_probs).abs(), 0.0)
    return {  # 0-dim tensors: the training loop reads its metrics from the device once (openppo.utils.transfer)
        "logprob_diff": diff.sum() / inside.sum().clamp(min=1),
        "logprob_diff_max": diff.max() if diff.numel() else diff.new_zeros(()),
        "outside_support": outside.sum() / keep.sum().clamp(min=1),
    }
