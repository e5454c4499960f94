"""Packed forwards equal padded ones: log-probs, entropy, values and gradients on ragged rows (fp32, 1e-5)."""

from __future__ import annotations

import pytest
import torch

from openppo.models.actor import Actor
from openppo.models.row_layout import RowLayout, pack_rows, unpack_rows
from openppo.models.scalar import ScalarModel
from openppo.ppo.batching import trim_padding
from tests.model_cache import tiny_model_dir

LENGTHS = [5, 17, 9, 30, 1]


def _batch():
    torch.manual_seed(0)
    width = max(LENGTHS)
    seqs = torch.randint(10, 1000, (len(LENGTHS), width))
    attn = torch.zeros_like(seqs)
    for row, n in enumerate(LENGTHS):
        attn[row, :n] = 1
    seqs[attn == 0] = 0
    return seqs, attn


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_close(a, b, tol=1e-5):
    assert a.keys() == b.keys()
    for k in a:
        assert (a[k] - b[k]).abs().max().item() <= tol, k


def test_pack_unpack_roundtrip():
    seqs, attn = _batch()
    packed = pack_rows(seqs, attn)
    assert packed.input_ids.shape == (1, sum(LENGTHS))
    assert packed.position_ids[0, :7].tolist() == [0, 1, 2, 3, 4, 0, 1]
    unpacked = unpack_rows(packed.input_ids.unsqueeze(-1), packed.token_mask, packed.token_index)
    assert torch.equal(unpacked.squeeze(-1), seqs)
    trimmed = trim_padding({"sequences": seqs[:1], "attention_mask": attn[:1], "m": torch.ones(1, 29)})
    assert trimmed["sequences"].shape == (1, 5) and trimmed["m"].shape == (1, 4)


def test_actor_packed_equals_padded():
    seqs, attn = _batch()
    model = Actor.from_pretrained(str(tiny_model_dir()), dtype=torch.float32)
    valid = attn[:, 1:].bool()
    weights = torch.randn(valid.shape) * valid
    results = []
    for pack in (False, True):
        model.zero_grad()
        model.layout = RowLayout(packed=pack)
        out = model(seqs, attn, temperature=0.7, return_entropy=True)
        ((out.log_probs + 0.1 * out.entropy) * weights).sum().backward()
        results.append((out.log_probs.detach(), out.entropy.detach(), _grads(model)))
    (lp, ent, grads), (lp_p, ent_p, grads_p) = results
    assert (lp - lp_p)[valid].abs().max() <= 1e-5
    assert (ent - ent_p)[valid].abs().max() <= 1e-5
    _assert_close(grads, grads_p)


def test_actor_sampling_log_probs_on_every_layout():
    """The engine-distribution log-probs (top-k/top-p) of padded, response-only (`score_mask`) and packed forwards
    equal the formula applied to the full logits; the plain log-probs are unchanged by asking for them."""
    from openppo.algorithms import SamplingFilter, sampling_log_probs

    seqs, attn = _batch()
    model = Actor.from_pretrained(str(tiny_model_dir()), dtype=torch.float32)
    sampling = SamplingFilter(top_k=100_000, top_p=0.8)
    score = attn[:, 1:].clone()
    score[:, :3] = 0  # a "prompt" of 3 tokens per row is not scored
    with torch.no_grad():
        logits = model(seqs, attn, return_logits=True).logits[:, :-1]
        expected = sampling_log_probs(logits, seqs[:, 1:], 0.7, sampling)
        plain = model(seqs, attn, temperature=0.7).log_probs
    valid = score.bool()
    assert not torch.isneginf(expected[valid]).all() and torch.isneginf(expected[valid]).any()
    for pack, kwargs in ((False, {}), (False, {"score_mask": score}), (True, {}), (True, {"score_mask": score})):
        model.layout = RowLayout(packed=pack)
        with torch.no_grad():
            out = model(seqs, attn, temperature=0.7, sampling=sampling, **kwargs)
        got = out.sampling_log_probs
        assert torch.equal(torch.isneginf(got[valid]), torch.isneginf(expected[valid])), kwargs
        finite = valid & ~torch.isneginf(expected)
        assert (got - expected)[finite].abs().max() <= 1e-5, kwargs
        assert (out.log_probs - plain)[valid].abs().max() <= 1e-5, kwargs
        assert (got[finite] > out.log_probs[finite]).all()  # renormalised over fewer tokens: more likely


def test_scalar_model_packed_equals_padded():
    seqs, attn = _batch()
    model = ScalarModel.from_pretrained(str(tiny_model_dir()), dtype=torch.float32, flag="--critic_pretrain")
    valid = attn.bool()
    weights = torch.randn(valid.shape) * valid
    results = []
    for pack in (False, True):
        model.zero_grad()
        model.layout = RowLayout(packed=pack)
        values = model(seqs, attn)
        (values * weights).sum().backward()
        results.append((values.detach(), _grads(model)))
    (v, grads), (v_p, grads_p) = results
    assert (v - v_p)[valid].abs().max() <= 1e-5
    _assert_close(grads, grads_p)


@pytest.mark.parametrize(
    "lengths,calls",
    [
        ([5, 3, 4], [(3, 5)]),  # similar lengths: one call over the 3 sequences right-padded to 5 (3 x 25 <= 2 x 50)
        ([9, 1, 2], [(1, 9), (1, 1), (1, 2)]),  # padding would cost 243 scores for 86: one call per sequence
    ],
)
def test_varlen_attention_is_used_and_equals_masked_sdpa(lengths, calls):
    """Packed forwards attend sequence by sequence (no N x N mask), batched when padding wastes little; either way
    the result and its gradient equal sdpa's block-diagonal mask."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from openppo.models import varlen_attention

    model = Actor.from_pretrained(str(tiny_model_dir()), dtype=torch.float32)
    assert model.config._attn_implementation == varlen_attention.ATTN_IMPLEMENTATION
    module = model.model.model.layers[0].self_attn
    n = sum(lengths)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, n, 32, requires_grad=True) for _ in range(3))
    position_ids = torch.cat([torch.arange(length) for length in lengths])[None]
    seq = torch.cat([torch.full((length,), i) for i, length in enumerate(lengths)])
    causal = torch.tril(torch.ones(n, n, dtype=torch.bool))
    block_mask = (causal & (seq[:, None] == seq[None, :]))[None, None]
    expected, _ = sdpa_attention_forward(module, q, k, v, block_mask, scaling=32**-0.5)
    seen, original = [], varlen_attention.sdpa_attention_forward

    def counted(module, query, *args, **kwargs):
        seen.append((query.shape[0], query.shape[2]))  # (batch, length) of each sdpa call
        return original(module, query, *args, **kwargs)

    varlen_attention.sdpa_attention_forward = counted
    try:
        varlen_attention.set_packed_rows(position_ids)
        out, _ = varlen_attention.varlen_attention_forward(module, q, k, v, None, scaling=32**-0.5)
    finally:
        varlen_attention.sdpa_attention_forward = original
        varlen_attention.set_packed_rows(None)
    assert seen == calls
    assert out.shape == expected.shape and (out - expected).abs().max() <= 1e-6
    weights = torch.randn_like(out)
    got = torch.autograd.grad((out * weights).sum(), (q, k, v))
    want = torch.autograd.grad((expected * weights).sum(), (q, k, v))
    for g, w in zip(got, want):
        assert (g - w).abs().max() <= 1e-5


def test_half_precision_attention_on_cpu_runs_in_fp32_up_to_the_limit(monkeypatch):
    """bf16 queries of at most CPU_FP32_ATTENTION_MAX_LEN tokens attend in fp32 (PyTorch's fp32 CPU kernel is the
    faster one there) and come back in bf16; longer ones keep the native bf16 kernel."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from openppo.models import varlen_attention

    model = Actor.from_pretrained(str(tiny_model_dir()), dtype=torch.float32)
    module = model.model.model.layers[0].self_attn
    torch.manual_seed(0)
    q, k, v = (torch.randn(3, 2, 24, 32, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    out, _ = varlen_attention._sdpa(module, q, k, v, None, scaling=32**-0.5)
    upcast, _ = sdpa_attention_forward(module, q.float(), k.float(), v.float(), None, scaling=32**-0.5)
    native, _ = sdpa_attention_forward(module, q, k, v, None, scaling=32**-0.5)
    assert out.dtype == torch.bfloat16 and torch.equal(out, upcast.to(torch.bfloat16))
    assert not torch.equal(out, native)  # the two kernels round differently: the test tells them apart
    assert all(g is not None and g.dtype == torch.bfloat16 for g in torch.autograd.grad(out.float().sum(), (q, k, v)))
    monkeypatch.setattr(varlen_attention, "CPU_FP32_ATTENTION_MAX_LEN", 23)
    assert torch.equal(varlen_attention._sdpa(module, q, k, v, None, scaling=32**-0.5)[0], native)


def test_scoring_only_the_action_positions_changes_nothing_there():
    """`score_mask` runs the LM head on the masked positions only: same log-probs, entropy and gradients there, 0
    elsewhere (padded batches keep every column some row needs), padded and packed; an all-false mask (a no-op
    micro-batch) still reaches every weight."""
    seqs, attn = _batch()
    model = Actor.from_pretrained(str(tiny_model_dir()), dtype=torch.float32)
    assert model._takes_logits_to_keep
    score = attn[:, 1:].bool().clone()
    score[:, :3] = False  # a 3-token "prompt" in every row
    weights = torch.randn(score.shape) * score
    for pack in (False, True):
        model.layout = RowLayout(packed=pack)
        results = []
        for mask in (None, score):
            model.zero_grad()
            out = model(seqs, attn, temperature=0.7, return_entropy=True, score_mask=mask)
            ((out.log_probs + 0.1 * out.entropy) * weights).sum().backward()
            results.append((out.log_probs.detach(), out.entropy.detach(), _grads(model)))
        (lp, ent, grads), (lp_s, ent_s, grads_s) = results
        assert (lp - lp_s)[score].abs().max() <= 1e-5 and (ent - ent_s)[score].abs().max() <= 1e-5
        unscored = ~score if pack else ~score.any(0).expand_as(score)  # padded: whole columns are kept or not
        assert unscored.any() and lp_s[unscored].eq(0).all() and ent_s[unscored].eq(0).all()
        _assert_close(grads, grads_s)
    model.zero_grad()
    out = model(seqs, attn, score_mask=torch.zeros_like(score))  # packed
    (out.log_probs.sum() * 0).backward()
    assert len(_grads(model)) == len(list(model.parameters()))
