"""Ring attention against single-rank sdpa on a tiny random Qwen3 (packed rows, 2 gloo ranks on CPU).

The 2-rank cases run in one spawn of two workers (a module fixture): each rank builds the same model, computes the
sdpa reference on the full packed row itself, then its chunk with ring attention, and writes the max errors to a
JSON file that the parametrized tests read.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from openppo.distributed.rendezvous import join_store
from openppo.models.ring_attention import (
    ATTN_IMPLEMENTATION,
    enable_ring_attention,
    gather_from_ring,
    register_ring_attention,
    ring_attention_forward,
    ring_chunk,
    ring_context,
    split_for_ring,
)
from openppo.models.row_layout import packed_position_ids
from tests.spawn import run_ranks

ROWS = {"even": [7, 12, 5], "odd": [7, 11, 5]}  # N = 24 and N = 23 (padded to 24 on 2 ranks)
HEAD_STRIDES = [0, 1]  # in KV heads: all 2 at once, then one KV head (2 query heads) per step
RTOL = ATOL = 1e-5
WORLD = 2
TIMEOUT_S = 120


def tiny_model(attn_implementation: str = "sdpa") -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    # A wide init (0.3, not 0.02) so attention is far from uniform and a wrong mask moves the numbers.
    config = Qwen3Config(
        vocab_size=500,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        initializer_range=0.3,
        tie_word_embeddings=False,
        use_cache=False,
        attn_implementation=attn_implementation,
    )
    return Qwen3ForCausalLM(config).float().train()


def packed_row(seq_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids, position_ids [1, N] and fixed random per-token loss weights [1, N]."""
    gen = torch.Generator().manual_seed(len(seq_lens) * 100 + sum(seq_lens))
    n = sum(seq_lens)
    return (
        torch.randint(1, 500, (1, n), generator=gen),
        packed_position_ids(seq_lens),
        torch.randn(1, n, generator=gen),
    )


def next_token_log_probs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return logits.log_softmax(-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def weighted_loss(log_probs: torch.Tensor, position_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Sum of weighted next-token log-probs inside each sequence (the label of a sequence's last token is the next
    sequence's first token: masked, as is the wrap-around of the row's last token)."""
    within = position_ids.roll(-1, dims=1) == position_ids + 1
    return (log_probs * weights * within).sum()


def reference(model: torch.nn.Module, seq_lens: list[int]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Single-rank sdpa over the full packed row: logits [1, N, V] and the loss's parameter gradients."""
    model.set_attn_implementation("sdpa")
    input_ids, position_ids, weights = packed_row(seq_lens)
    model.zero_grad()
    logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
    weighted_loss(next_token_log_probs(logits, input_ids.roll(-1, dims=1)), position_ids, weights).backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def max_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest |actual - expected| beyond the tolerance ATOL * max(1, max |expected|) + RTOL * |expected| (<= 0
    means within it). The absolute part scales with the tensor: a gradient is a sum over tokens whose order differs
    between the ring and one rank, and with AVX2 kernels (other GEMM blocking) a gradient element was off by ~2e-5,
    past an absolute 1e-5."""
    scale = max(1.0, expected.abs().max().item())
    return ((actual - expected).abs() - ATOL * scale - RTOL * expected.abs()).max().item()


# ----------------------------------------------------------------------------------------------------------------
# Two ranks


def _ring_case(model, group, seq_lens, head_stride) -> dict[str, float]:
    """This rank's chunk through ring attention; returns errors against the sdpa reference."""
    ref_logits, ref_grads = reference(model, seq_lens)
    enable_ring_attention(model)
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    input_ids, position_ids, weights = packed_row(seq_lens)
    n = input_ids.shape[1]
    shard = split_for_ring(input_ids, position_ids, rank, size)
    labels = ring_chunk(input_ids.roll(-1, dims=1), rank, size)  # shift on the full row, then chunk
    model.zero_grad()
    with ring_context(position_ids, group, head_stride=head_stride):
        logits = model(input_ids=shard.input_ids, position_ids=shard.position_ids, use_cache=False).logits
        log_probs = gather_from_ring(next_token_log_probs(logits, labels), group, num_tokens=n)
        weighted_loss(log_probs, position_ids, weights).backward()
    full_logits = gather_from_ring(logits.detach(), group, num_tokens=n)
    grads = {}
    for name, p in model.named_parameters():
        dist.all_reduce(p.grad, group=group)  # the row's gradient is the sum of the ranks' parts
        grads[name] = p.grad
    return {
        "logits": max_error(full_logits, ref_logits),
        "grads": max(max_error(grads[k], ref_grads[k]) for k in ref_grads),
        "pad_len": shard.pad_len,
    }


def _attention_case(group, dtype: torch.dtype, head_stride: int) -> dict[str, float]:
    """ring_attention_forward on random q/k/v (GQA 4/2 heads): output and q/k/v grads against fp32 masked sdpa."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    gen = torch.Generator().manual_seed(7)
    position_ids = packed_position_ids([5, 14, 9])  # N = 28, chunks of 14; the long sequence spans both
    n = position_ids.shape[1]
    q, k, v = (torch.randn(1, h, n, 16, generator=gen).to(dtype) for h in (4, 2, 2))
    dout = torch.randn(1, n, 4, 16, generator=gen).to(dtype)

    full = [t.float().requires_grad_() for t in (q, k, v)]
    seq = torch.tensor([0] * 5 + [1] * 14 + [2] * 9)
    mask = (seq[:, None] == seq[None, :]) & torch.ones(n, n, dtype=torch.bool).tril()
    ref = torch.nn.functional.scaled_dot_product_attention(*full, attn_mask=mask, enable_gqa=True)
    ref.transpose(1, 2).backward(dout.float())

    local = [ring_chunk(t.transpose(1, 2), rank, size).transpose(1, 2).detach().requires_grad_() for t in (q, k, v)]
    module = torch.nn.Module()
    module.is_causal = True
    with ring_context(position_ids, group, head_stride=head_stride):
        out, _ = ring_attention_forward(module, *local, attention_mask=None, scaling=16**-0.5)
    out.backward(ring_chunk(dout, rank, size))
    errors = {"out": (out.float() - ring_chunk(ref.transpose(1, 2), rank, size)).abs().max().item()}
    for name, mine, theirs in zip("qkv", local, full):
        expected = ring_chunk(theirs.grad.transpose(1, 2), rank, size).transpose(1, 2)
        errors[f"d{name}"] = (mine.grad.float() - expected).abs().max().item()
    errors["dtype_kept"] = float(out.dtype == dtype and local[1].grad.dtype == dtype)
    return errors


def _worker(rank: int, out_dir: str, port: int) -> None:
    torch.set_num_threads(1)  # 2 ranks on 2 cores
    store = join_store("127.0.0.1", port, WORLD, timeout_s=60)  # run_ranks's process serves it
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    try:
        group = dist.new_group(list(range(WORLD)))  # a subgroup, like the trainer's ring groups
        model = tiny_model()
        results = {}
        for row, seq_lens in ROWS.items():
            for stride in HEAD_STRIDES:
                results[f"{row}-stride{stride}"] = _ring_case(model, group, seq_lens, stride)
        model.gradient_checkpointing_enable()  # the backward recomputes attention: still inside the context
        results["even-stride0-checkpointing"] = _ring_case(model, group, ROWS["even"], 0)
        for dtype in (torch.float32, torch.bfloat16):
            for stride in HEAD_STRIDES:
                results[f"attention-{str(dtype)[6:]}-stride{stride}"] = _attention_case(group, dtype, stride)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ring_results(tmp_path_factory) -> list[dict]:
    return run_ranks(_worker, WORLD, tmp_path_factory.mktemp("ring"), TIMEOUT_S, "ring attention")


@pytest.mark.parametrize(
    "case", [f"{row}-stride{s}" for row in ROWS for s in HEAD_STRIDES] + ["even-stride0-checkpointing"]
)
def test_two_ranks_match_single_rank_sdpa(ring_results, case):
    for rank, results in enumerate(ring_results):
        r = results[case]
        assert r["logits"] <= 0 and r["grads"] <= 0, f"rank {rank}: {r}"
    assert ring_results[0][case]["pad_len"] == (1 if case.startswith("odd") else 0)


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-5), ("bfloat16", 5e-2)])
@pytest.mark.parametrize("stride", HEAD_STRIDES)
def test_ring_attention_function_gqa(ring_results, dtype, tol, stride):
    """bf16 tolerance: inputs/outputs rounded to bf16 (8 mantissa bits) against an fp32 reference."""
    for rank, results in enumerate(ring_results):
        r = results[f"attention-{dtype}-stride{stride}"]
        assert r.pop("dtype_kept") == 1.0
        assert max(r.values()) <= tol, f"rank {rank}: {r}"


# ----------------------------------------------------------------------------------------------------------------
# Single process


def test_split_for_ring_pads_and_chunks():
    input_ids, position_ids, _ = packed_row(ROWS["odd"])  # N = 23
    shards = [split_for_ring(input_ids, position_ids, r, 2, pad_token_id=-1) for r in range(2)]
    assert [s.pad_len for s in shards] == [1, 1]
    assert all(s.input_ids.shape == (1, 12) for s in shards)
    ids = torch.cat([s.input_ids for s in shards], dim=1)
    pos = torch.cat([s.position_ids for s in shards], dim=1)
    assert torch.equal(ids[:, :23], input_ids) and ids[0, 23] == -1
    assert torch.equal(pos[:, :23], position_ids) and pos[0, 23] == 0  # the pad tail is its own sequence
    # Labels cross the chunk border: chunk 0's last label is chunk 1's first token.
    labels = [ring_chunk(input_ids.roll(-1, dims=1), r, 2) for r in range(2)]
    assert labels[0][0, -1] == shards[1].input_ids[0, 0]


def test_without_context_it_is_sdpa():
    """Packed row (mask from position_ids) and a left-padded batch (the mask must not be dropped)."""
    sdpa, ring = tiny_model(), tiny_model()
    enable_ring_attention(ring)
    assert ring.config._attn_implementation == ATTN_IMPLEMENTATION
    input_ids, position_ids, _ = packed_row(ROWS["even"])
    kwargs = dict(input_ids=input_ids, position_ids=position_ids, use_cache=False)
    torch.testing.assert_close(ring(**kwargs).logits, sdpa(**kwargs).logits, rtol=0, atol=0)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, :4] = 0
    padded = dict(input_ids=input_ids[:, :24].view(2, 12), attention_mask=mask, use_cache=False)
    torch.testing.assert_close(ring(**padded).logits, sdpa(**padded).logits, rtol=0, atol=0)


@pytest.mark.parametrize("head_stride", HEAD_STRIDES)
def test_one_rank_ring_matches_sdpa(head_stride):
    """The ring code path without communication (group=None): logits and gradients equal sdpa's."""
    model = tiny_model()
    ref_logits, ref_grads = reference(model, ROWS["odd"])
    enable_ring_attention(model)
    input_ids, position_ids, weights = packed_row(ROWS["odd"])
    model.zero_grad()
    with ring_context(position_ids, None, head_stride=head_stride):
        logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
        weighted_loss(next_token_log_probs(logits, input_ids.roll(-1, dims=1)), position_ids, weights).backward()
    assert max_error(logits, ref_logits) <= 0
    for name, p in model.named_parameters():
        assert max_error(p.grad, ref_grads[name]) <= 0, name


def test_head_stride_must_divide_kv_heads():
    register_ring_attention()  # then the name works at construction, as with from_pretrained
    model = tiny_model(ATTN_IMPLEMENTATION)
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION
    input_ids, position_ids, _ = packed_row(ROWS["even"])
    with pytest.raises(ValueError, match="head_stride 3 must divide"):
        with ring_context(position_ids, None, head_stride=3):
            model(input_ids=input_ids, position_ids=position_ids, use_cache=False)
    with pytest.raises(ValueError, match="head_stride must be >= 0"):
        with ring_context(position_ids, None, head_stride=-1):
            pass
