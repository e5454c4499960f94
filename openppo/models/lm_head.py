"""The vocabulary projection in chunks (--lm_head_chunk_tokens): per-token log-probs and entropy from the decoder's
hidden states, never the full tokens x vocabulary logits.

A causal LM's forward ends with `logits = lm_head(hidden)`: [N, V] for N scored tokens, 8192 x 151,936 for a Qwen2.5
micro-batch, 2.5 GB in bf16, kept for backward, and then a gradient of the same size. Here the hidden states
[N, H] go through the head `chunk_tokens` rows at a time, and one chunk's logits (and their gradient) exist at a
time. The price is the head's matmul once more in backward (2 N H V more flops, on the head's 6 N H V).

- A plain linear head whose weight is an ordinary tensor (ZeRO-0/1/2, tied or not): `_HeadLogProbs`, one autograd
  function. Forward makes each chunk's logits and keeps only the log-probs and the logged entropy; backward makes
  the chunk's logits again, their gradient, and from it the hidden states' gradient and the chunk's share of the
  weight's (and bias's). The chunk math after the matmul is the full path's (`chunk_scores`, `chunk_gradient`),
  compiled under --torch_compile.
- Otherwise (a ZeRO-3 partitioned head, an entropy with gradient for --entropy_loss_coef): the head is called as a
  module under activation checkpointing per chunk (`torch.utils.checkpoint`), so that what wraps it (ZeRO-3's gather)
  runs as in the model's own forward. Under ZeRO-3 each call is a collective (the gather in forward and again in
  backward, the gradient's reduce-scatter), so every rank makes as many calls: the number of chunks is the largest
  any rank needs (one all-reduce), and a rank with fewer tokens makes smaller chunks, or empty ones.
Either way the arithmetic per position is the full path's (the chunk's logits in the model's dtype, then fp32 as in
`openppo.algorithms.entropy`): the values differ only by the rounding of smaller matmuls (fp32: within 1e-6,
tests/models/test_lm_head.py). Models whose logits are more than `lm_head(hidden)` (a soft cap, a logit scale) keep
the full path (`unsupported_reason`).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

from openppo.algorithms import (
    SamplingFilter,
    entropy_from_logits,
    log_probs_and_entropy,
    log_probs_from_logits,
    sampling_log_probs,
)
from openppo.algorithms.entropy import chunk_gradient, chunk_scores

# config attributes of transformers models whose forward changes the logits after the head
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def unsupported_reason(hf_model: nn.Module) -> str | None:
    """Why the chunked head cannot stand in for this model's logits (None when it can)."""
    config = hf_model.config
    for name in _LOGIT_TRANSFORMS:
        if getattr(config, name, None) not in (None, 1, 1.0):
            return f"{type(hf_model).__name__} transforms its logits after the head ({name}={getattr(config, name)})"
    if not hasattr(hf_model, "get_decoder") or not isinstance(hf_model.get_output_embeddings(), nn.Linear):
        return f"{type(hf_model).__name__} has no plain decoder + linear head"
    return None


def _scores(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, temperature: float, entropy: bool | str):
    """(log-probs [n], entropy [n] or an empty tensor) of one chunk of hidden states [n, H]."""
    logits = head(hidden)
    if entropy == "log":
        return log_probs_and_entropy(logits, labels, temperature)
    log_probs = log_probs_from_logits(logits, labels, temperature)
    if entropy:
        return log_probs, entropy_from_logits(logits, temperature)
    return log_probs, log_probs.new_empty(0)


def _plain(head: nn.Module) -> bool:
    """A linear head whose parameters are ordinary tensors (not ZeRO-3 partitions, no adapter around it)."""
    return type(head) is nn.Linear and not any(hasattr(p, "ds_id") for p in head.parameters())


class _HeadLogProbs(torch.autograd.Function):
    """log p(label) [N] (and the logged entropy [N], no gradient) of hidden [N, H] through a linear head, chunk by
    chunk in forward and in backward (module docstring). Each chunk's logits go through the full path's chunk math
    (`openppo.algorithms.entropy`), compiled with `compiled` (--torch_compile)."""

    @staticmethod
    def forward(
        ctx, hidden, weight, bias, labels, temperature: float, chunk_tokens: int, with_entropy: bool, compiled: bool
    ):
        n = labels.numel()
        out = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(n if with_entropy else 0, dtype=torch.float32, device=hidden.device)
        scores = chunk_scores(compiled)
        for start in range(0, n, chunk_tokens):
            c = slice(start, start + chunk_tokens)
            out[c], ent = scores(nn.functional.linear(hidden[c], weight, bias), labels[c], temperature, with_entropy)
            if with_entropy:
                entropy[c] = ent
        ctx.save_for_backward(hidden, weight, bias, labels)
        ctx.temperature, ctx.chunk_tokens, ctx.compiled = temperature, chunk_tokens, compiled
        ctx.mark_non_differentiable(entropy)
        return out, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out, _grad_entropy):
        hidden, weight, bias, labels = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        with_bias = bias is not None and ctx.needs_input_grad[2]
        grad_bias = torch.zeros_like(bias, dtype=torch.float32) if with_bias else None
        # d log p(y) / d z = onehot(y) - softmax(z), in the logits' dtype as the full path's gradient is
        gradient = chunk_gradient(ctx.compiled)
        for start in range(0, labels.numel(), ctx.chunk_tokens):
            c = slice(start, start + ctx.chunk_tokens)
            logits = nn.functional.linear(hidden[c], weight, bias)  # made again, not kept
            gz = gradient(logits, labels[c], grad_out[c], ctx.temperature)
            del logits
            if grad_hidden is not None:
                grad_hidden[c] = gz @ weight
            if grad_weight is not None:
                grad_weight += gz.t() @ hidden[c]  # summed in fp32, without an fp32 copy of the chunk's share
            if grad_bias is not None:
                grad_bias += gz.float().sum(0)
        grad_weight = None if grad_weight is None else grad_weight.to(weight.dtype)
        grad_bias = None if grad_bias is None else grad_bias.to(bias.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None


def _chunk_count(tokens: int, chunk_tokens: int, head: nn.Module, device: torch.device) -> int:
    """Chunks of at most `chunk_tokens` positions; with a ZeRO-3 partitioned head, the most any rank needs."""
    count = math.ceil(tokens / chunk_tokens)
    if any(hasattr(p, "ds_id") for p in head.parameters()) and dist.is_initialized() and dist.get_world_size() > 1:
        most = torch.tensor([count], device=device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX)
        count = int(most.item())
    return count


def head_scores(
    hidden: torch.Tensor,
    head: nn.Module,
    labels: torch.Tensor,
    temperature: float,
    *,
    chunk_tokens: int,
    entropy: bool | str = False,
    sampling: SamplingFilter | None = None,
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(log-probs, entropy, log-probs under the engine's `sampling` truncation) of `labels` [..., n] from `hidden`
    [..., n, H], each [..., n] like `labels`. `entropy`: True with gradient, "log" detached, False none; the
    sampling log-probs have no gradient (None without an active filter). `compiled` (--torch_compile): the chunks'
    math after the head's matmul compiled, on the plain head's path."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    shape = labels.shape
    flat, flat_labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    n = flat_labels.numel()
    if torch.is_grad_enabled() and entropy is not True and _plain(head):
        args = (flat_labels.long(), float(temperature), chunk_tokens, entropy == "log", compiled)
        log_probs, ent = _HeadLogProbs.apply(flat, head.weight, head.bias, *args)
        beh = _sampling_scores(flat, flat_labels, head, temperature, sampling, math.ceil(n / chunk_tokens))
        return log_probs.reshape(shape), ent.reshape(shape) if entropy else None, _shaped(beh, shape)
    count = _chunk_count(n, chunk_tokens, head, flat.device)
    train = torch.is_grad_enabled()
    log_probs, entropies = [], []
    for h, y in zip(flat.tensor_split(count), flat_labels.tensor_split(count)) if count else ():
        if train:  # the chunk's logits are made again in backward instead of kept
            lp, ent = checkpoint(_scores, head, h, y, temperature, entropy, use_reentrant=False)
        else:
            lp, ent = _scores(head, h, y, temperature, entropy)
        log_probs.append(lp)
        entropies.append(ent)
    out = torch.cat(log_probs).reshape(shape) if log_probs else hidden.new_zeros(shape, dtype=torch.float32)
    ent = torch.cat(entropies).reshape(shape) if entropy and entropies else None
    return out, ent, _shaped(_sampling_scores(flat, flat_labels, head, temperature, sampling, count), shape)


def _sampling_scores(flat, labels, head: nn.Module, temperature: float, sampling, count: int) -> torch.Tensor | None:
    """The labels' log-probs under the engine's truncated distribution (an active `sampling` filter), in `count`
    chunks, without gradient (for comparisons with the engine's); None without an active filter. Under ZeRO-3 every
    rank calls the head `count` times (`_chunk_count`), so the gathers match."""
    if sampling is None or not sampling.active or not count:
        return None
    with torch.no_grad():
        pieces = zip(flat.tensor_split(count), labels.tensor_split(count))
        return torch.cat([sampling_log_probs(head(h), y, temperature, sampling) for h, y in pieces])


def _shaped(values: torch.Tensor | None, shape: torch.Size) -> torch.Tensor | None:
    return None if values is None else values.reshape(shape)
