"""Token log-probs and entropy from logits, without a full-vocabulary fp32 copy of the batch.

Logits are [B, T, V] with V ~ 150k: in bf16 a 4 x 8192-token micro-batch is already 10 GB, and the obvious
`logits.float().log_softmax(-1)` adds a 20 GB fp32 copy, plus another for autograd to keep for backward. Here both
quantities are custom autograd functions that walk the positions in chunks of `chunk_size` tokens:
  * forward upcasts one chunk at a time (chunk_size x V in fp32) and keeps only the [B, T] result;
  * backward recomputes the chunk's softmax from the saved logits (which exist anyway) and writes the gradient,
    in the logits' dtype, straight into the one gradient tensor autograd needs.
So the extra memory is one chunk, forward and backward, whatever B and T are. Slices such as `logits[:, :-1]` are
fine: chunks are views, nothing is flattened or copied.

Results are fp32 for fp32/bf16/fp16 logits and fp64 for fp64 logits. `temperature` divides the logits as the
rollout engine did when sampling (so log-probs match the sampling distribution); at 1.0 no divided copy is made.
`log_probs_and_entropy` also returns the entropy for logging from the same pass over each chunk (one logsumexp,
no logarithm per vocabulary entry: H = logsumexp(z) - sum_v p_v z_v).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch
from torch.autograd.function import once_differentiable

DEFAULT_CHUNK_SIZE = 1024  # positions a chunk on GPUs, where each chunk costs a few kernel launches
# On CPU the passes over a chunk (logsumexp, gather, entropy; softmax in backward) run from cache when the chunk's
# fp32 logits take a few MiB, instead of streaming from memory (docs/benchmarks.md, "Measurements behind code
# defaults").
CPU_CHUNK_BYTES = 4 << 20


def default_chunk_size(logits: torch.Tensor) -> int:
    """Positions a chunk for these logits: cache-sized on CPU, DEFAULT_CHUNK_SIZE elsewhere."""
    if logits.device.type == "cpu":
        return max(1, CPU_CHUNK_BYTES // (logits.shape[-1] * 4))
    return DEFAULT_CHUNK_SIZE


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunks(batch: int, length: int, chunk_size: int) -> Iterator[tuple[slice, slice]]:
    """(rows, positions) index pairs covering [batch, length] with about chunk_size positions each."""
    if length >= chunk_size:
        for b in range(batch):
            for t in range(0, length, chunk_size):
                yield slice(b, b + 1), slice(t, min(t + chunk_size, length))
    elif length > 0:
        rows = max(1, chunk_size // length)
        for b in range(0, batch, rows):
            yield slice(b, min(b + rows, batch)), slice(0, length)


def _scaled(chunk: torch.Tensor, dtype: torch.dtype, temperature: float) -> torch.Tensor:
    """A chunk of logits in the compute dtype over the temperature: a view when neither changes it (read only)."""
    z = chunk.to(dtype)
    return z if temperature == 1.0 else z / temperature


def chunk_entropy(z: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """H = lse - sum_v p_v z_v with p = exp(z - lse). A logit of -inf (a banned token) has p = 0 and adds nothing
    (its 0 * -inf = NaN is zeroed)."""
    pz = torch.exp(z - lse.unsqueeze(-1)).mul_(z)
    return lse - torch.nan_to_num_(pz, nan=0.0).sum(dim=-1)


def _log_probs_chunk(
    chunk: torch.Tensor, labels: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(label) of one chunk of logits, and its entropy with `with_entropy`."""
    z = _scaled(chunk, _compute_dtype(chunk.dtype), temperature)
    lse = torch.logsumexp(z, dim=-1)
    out = z.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - lse
    return out, chunk_entropy(z, lse) if with_entropy else None


def _log_probs_chunk_grad(
    chunk: torch.Tensor, labels: torch.Tensor, grad_out: torch.Tensor, temperature: float
) -> torch.Tensor:
    """The gradient of one chunk's log p(label) (in the compute dtype)."""
    dtype = _compute_dtype(chunk.dtype)
    z = _scaled(chunk, dtype, temperature)
    g = grad_out.to(dtype).unsqueeze(-1)
    # d log p(y) / d z = onehot(y) - softmax(z); the chain rule through z = logits / T adds 1 / T.
    gz = torch.softmax(z, dim=-1).mul_(-g)
    gz.scatter_add_(-1, labels.unsqueeze(-1), g)
    return gz if temperature == 1.0 else gz.div_(temperature)


def _log_probs_chunk_grad_cast(chunk, labels, grad_out, temperature):
    """`_log_probs_chunk_grad` in the logits' dtype (compiled: the cast fused into the same kernel)."""
    return _log_probs_chunk_grad(chunk, labels, grad_out, temperature).to(chunk.dtype)


@functools.cache
def _compiled(fn):
    """`fn` compiled once for any chunk shape (--torch_compile). Eager, each chunk's softmax, entropy and gradient
    are a dozen passes over its fp32 logits, each a kernel; compiled, a few fused ones (a GPU step's element-wise
    time, docs/performance.md)."""
    return torch.compile(fn, dynamic=True)


def chunk_scores(compiled: bool):
    """One chunk's log p(label) and entropy from its logits (`_log_probs_chunk`), compiled with `compiled`: the
    chunk math of this module's passes and of the LM head in chunks (`openppo.models.lm_head`)."""
    return _compiled(_log_probs_chunk) if compiled else _log_probs_chunk


def chunk_gradient(compiled: bool):
    """One chunk's gradient of log p(label) in the logits' dtype (`_log_probs_chunk_grad_cast`), compiled with
    `compiled`."""
    return _compiled(_log_probs_chunk_grad_cast) if compiled else _log_probs_chunk_grad_cast


class _LogProbs(torch.autograd.Function):
    """log p(label) per position; with `with_entropy` also the entropy (no gradient) from the same chunk pass.
    `compiled`: each chunk's math through `torch.compile` (the same values to rounding)."""

    @staticmethod
    def forward(
        ctx,
        logits: torch.Tensor,
        labels: torch.Tensor,
        temperature: float,
        chunk_size: int,
        with_entropy: bool,
        compiled: bool = False,
    ):
        dtype = _compute_dtype(logits.dtype)
        out = torch.empty(logits.shape[:-1], dtype=dtype, device=logits.device)
        entropy = torch.empty(logits.shape[:-1] if with_entropy else (0,), dtype=dtype, device=logits.device)
        scores = chunk_scores(compiled)
        for rows, cols in _chunks(logits.shape[0], logits.shape[1], chunk_size):
            out[rows, cols], ent = scores(logits[rows, cols], labels[rows, cols], temperature, with_entropy)
            if with_entropy:
                entropy[rows, cols] = ent
        ctx.save_for_backward(logits, labels)
        ctx.temperature, ctx.chunk_size, ctx.compiled = temperature, chunk_size, compiled
        ctx.mark_non_differentiable(entropy)
        return out, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor, _grad_entropy: torch.Tensor):
        logits, labels = ctx.saved_tensors
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        gradient = _compiled(_log_probs_chunk_grad_cast) if ctx.compiled else _log_probs_chunk_grad
        for rows, cols in _chunks(logits.shape[0], logits.shape[1], ctx.chunk_size):
            grad[rows, cols] = gradient(logits[rows, cols], labels[rows, cols], grad_out[rows, cols], ctx.temperature)
        return grad, None, None, None, None, None


class _Entropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, temperature: float, chunk_size: int):
        dtype = _compute_dtype(logits.dtype)
        out = torch.empty(logits.shape[:-1], dtype=dtype, device=logits.device)
        for rows, cols in _chunks(logits.shape[0], logits.shape[1], chunk_size):
            z = _scaled(logits[rows, cols], dtype, temperature)
            out[rows, cols] = chunk_entropy(z, torch.logsumexp(z, dim=-1))
        ctx.save_for_backward(logits, out)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        logits, entropy = ctx.saved_tensors
        dtype = _compute_dtype(logits.dtype)
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        for rows, cols in _chunks(logits.shape[0], logits.shape[1], ctx.chunk_size):
            p = torch.softmax(_scaled(logits[rows, cols], dtype, ctx.temperature), dim=-1)
            # dH/dz_j = -p_j (log p_j + H); again 1 / T for z = logits / T. xlogy(0, 0) = 0 for banned tokens.
            h = entropy[rows, cols].unsqueeze(-1)
            g = grad_out[rows, cols].to(dtype).unsqueeze(-1)
            gz = torch.special.xlogy(p, p).add_(p * h).mul_(-g / ctx.temperature)
            grad[rows, cols] = gz
        return grad, None, None


def _as_3d(logits: torch.Tensor, temperature: float, chunk_size: int | None) -> tuple[torch.Tensor, int]:
    """[B, T, V] logits and the chunk size (`default_chunk_size` when None)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if logits.dim() not in (2, 3):
        raise ValueError(f"logits must be [B, T, V] or [N, V], got {tuple(logits.shape)}")
    return (logits.unsqueeze(0) if logits.dim() == 2 else logits), chunk_size or default_chunk_size(logits)


def log_probs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    *,
    chunk_size: int | None = None,
    compiled: bool = False,
) -> torch.Tensor:
    """log softmax(logits / temperature)[label], chunked (see the module docstring).

    Shapes: logits [B, T, V] (or [N, V]), labels [B, T] (or [N]) int64 in [0, V) -> [B, T] (or [N]); no reduction.
    Align them yourself (logits at position t predict the token at t + 1). Gradient flows to `logits`.
    `compiled` (--torch_compile): each chunk's math compiled (`_compiled`).
    """
    logits3, chunk_size = _as_3d(logits, temperature, chunk_size)
    labels3 = labels.unsqueeze(0) if logits.dim() == 2 else labels
    if labels3.shape != logits3.shape[:-1]:
        raise ValueError(f"labels {tuple(labels.shape)} do not match logits {tuple(logits.shape)}")
    out, _ = _LogProbs.apply(logits3, labels3.long(), float(temperature), chunk_size, False, compiled)
    return out.squeeze(0) if logits.dim() == 2 else out


def log_probs_and_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    *,
    chunk_size: int | None = None,
    compiled: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`log_probs_from_logits` (with its gradient) and the entropy for logging (no gradient), in one pass."""
    logits3, chunk_size = _as_3d(logits, temperature, chunk_size)
    labels3 = labels.unsqueeze(0) if logits.dim() == 2 else labels
    if labels3.shape != logits3.shape[:-1]:
        raise ValueError(f"labels {tuple(labels.shape)} do not match logits {tuple(logits.shape)}")
    out, entropy = _LogProbs.apply(logits3, labels3.long(), float(temperature), chunk_size, True, compiled)
    return (out.squeeze(0), entropy.squeeze(0)) if logits.dim() == 2 else (out, entropy)


def entropy_from_logits(
    logits: torch.Tensor, temperature: float = 1.0, *, chunk_size: int | None = None
) -> torch.Tensor:
    """Entropy H = -sum_v p_v log p_v of softmax(logits / temperature) per position, chunked.

    Shapes: logits [B, T, V] (or [N, V]) -> [B, T] (or [N]); no reduction (mask and reduce with `aggregate_loss`
    for the entropy bonus, `--entropy_loss_coef`). Gradient flows to `logits`.
    """
    logits3, chunk_size = _as_3d(logits, temperature, chunk_size)
    out = _Entropy.apply(logits3, float(temperature), chunk_size)
    return out.squeeze(0) if logits.dim() == 2 else out
