"""Loss aggregation: contributions of micro-batches on several ranks sum to the single-batch value."""

import pytest
import torch

from openppo.algorithms import aggregate_loss, loss_normalizers

# 2 ranks x 2 micro-batches with ragged lengths and different padded widths
LENGTHS = [[[3, 1], [5]], [[2, 0, 4], [1, 6]]]  # rank -> micro-batch -> response lengths (0 = fully masked)


def _micro_batches(dtype):
    gen = torch.Generator().manual_seed(0)
    batches = []
    for rank in LENGTHS:
        for lengths in rank:
            width = max(lengths) + 2
            mask = torch.tensor([[t < n for t in range(width)] for n in lengths])
            loss = torch.randn(len(lengths), width, generator=gen, dtype=dtype)
            batches.append((loss, mask))
    return batches


def _reference(batches, mode, norm_len=None):
    # one flat list of sequences, reduced directly
    seqs = [loss[i][mask[i]] for loss, mask in batches for i in range(loss.shape[0]) if mask[i].any()]
    if mode == "token-mean":
        return torch.cat(seqs).mean()
    if mode == "seq-mean-token-mean":
        return torch.stack([s.mean() for s in seqs]).mean()
    if mode == "seq-mean-token-sum":
        return torch.stack([s.sum() for s in seqs]).mean()
    return torch.stack([s.sum() for s in seqs]).sum() / (len(seqs) * norm_len)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_contributions_sum_to_global_value(mode, dtype):
    batches = _micro_batches(dtype)
    # per rank: sum over its micro-batches; then the all-reduce (sum over ranks)
    num_tokens, num_seqs = sum(loss_normalizers(mask) for _, mask in batches).tolist()
    assert (num_tokens, num_seqs) == (3 + 1 + 5 + 2 + 0 + 4 + 1 + 6, 7)  # the empty response is not counted
    total = sum(
        aggregate_loss(loss, mask, mode, num_tokens_global=num_tokens, num_seqs_global=num_seqs, norm_len=8)
        for loss, mask in batches
    )
    assert total.dtype == dtype
    torch.testing.assert_close(total, _reference(batches, mode, norm_len=8))


def test_mean_of_micro_batch_means_differs():
    # why the global normaliser matters: the naive average weighs the tokens of short micro-batches more
    batches = _micro_batches(torch.float64)
    naive = torch.stack([aggregate_loss(loss, mask) for loss, mask in batches]).mean()
    assert not torch.isclose(naive, _reference(batches, "token-mean"))


def test_deepspeed_scaling_recovers_global_gradient():
    # DeepSpeed divides by grad-accum steps G and averages over D ranks; backward(contribution * D * G) undoes it
    weight = torch.tensor(2.0, requires_grad=True)
    batches = _micro_batches(torch.float32)
    num_tokens, _ = sum(loss_normalizers(mask) for _, mask in batches).tolist()
    D, G = 2, 2
    for loss, mask in batches:
        (aggregate_loss(weight * loss, mask, num_tokens_global=num_tokens) * D * G).backward()
    deepspeed_grad = weight.grad / (D * G)
    expected = torch.cat([loss[mask] for loss, mask in batches]).mean()  # d/dw of mean(w * l)
    torch.testing.assert_close(deepspeed_grad, expected)


def test_local_fallback_and_empty_batch():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    # token-mean: (1 + 2 + 3 + 4) / 4 = 2.5; seq-mean-token-mean: (2 + 4) / 2 = 3; seq-mean-token-sum: (6 + 4) / 2
    # = 5; sum-norm: 10 / (2 * 5) = 1
    assert aggregate_loss(loss, mask).item() == 2.5
    assert aggregate_loss(loss, mask, "seq-mean-token-mean").item() == 3.0
    assert aggregate_loss(loss, mask, "seq-mean-token-sum").item() == 5.0
    assert aggregate_loss(loss, mask, "seq-mean-token-sum-norm", norm_len=5).item() == 1.0
    empty = torch.zeros(2, 3, dtype=torch.bool)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum"):
        assert aggregate_loss(loss, empty, mode).item() == 0.0
    with pytest.raises(ValueError, match="mode='sum' is not one of"):
        aggregate_loss(loss, mask, "sum")
    with pytest.raises(ValueError):
        aggregate_loss(loss, mask, "seq-mean-token-sum-norm")
