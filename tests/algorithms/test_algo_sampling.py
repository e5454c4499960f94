"""The engine's top-k/top-p distribution as the trainer recomputes it: hand values, transformers' own warpers, the
actor's padded/packed/trimmed forwards, and the importance weights that use it."""

from __future__ import annotations

import math

import pytest
import torch

from openppo.algorithms import SamplingFilter, engine_gap, importance_weights, policy_loss, sampling_log_probs

PROBS = [0.5, 0.3, 0.15, 0.05]


def _score(probs, labels, temperature=1.0, top_k=-1, top_p=1.0):
    logits = torch.tensor([math.log(p) for p in probs], dtype=torch.float64).expand(len(labels), -1)
    return sampling_log_probs(logits, torch.tensor(labels), temperature, SamplingFilter(top_k, top_p)).tolist()


def test_hand_values():
    inf = float("-inf")
    # top-p 0.75: 0.5 is kept (nothing above it), 0.3 (0.5 above it < 0.75); 0.15 has 0.8 above it: dropped
    assert _score(PROBS, [0, 1, 2, 3], top_p=0.75) == pytest.approx(
        [math.log(0.5 / 0.8), math.log(0.3 / 0.8), inf, inf]
    )
    assert _score(PROBS, [0, 2, 3], top_p=0.85) == pytest.approx([math.log(0.5 / 0.95), math.log(0.15 / 0.95), inf])
    assert _score(PROBS, [1, 2], top_k=2) == pytest.approx([math.log(0.3 / 0.8), inf])
    # top-k 3 first (mass 0.95), then top-p 0.5 of the renormalised rest: 0.5 / 0.95 = 0.526 >= 0.5 alone
    assert _score(PROBS, [0, 1], top_k=3, top_p=0.5) == pytest.approx([0.0, inf])
    # temperature 2 first: p ~ sqrt(p); top-p 0.6 keeps the first two (0.379 above the second < 0.6)
    root = [math.sqrt(p) for p in PROBS]
    z = sum(root)
    kept = (root[0] + root[1]) / z
    assert _score(PROBS, [0, 1, 2], temperature=2.0, top_p=0.6) == pytest.approx(
        [math.log(root[0] / z / kept), math.log(root[1] / z / kept), inf]
    )
    # no truncation: the plain softmax
    assert _score(PROBS, [0, 3]) == pytest.approx([math.log(0.5), math.log(0.05)])


@pytest.mark.parametrize("top_k,top_p", [(-1, 0.9), (-1, 0.3), (50, 1.0), (50, 0.9), (1, 1.0), (999, 0.95)])
def test_matches_transformers_warpers(top_k, top_p):
    """transformers' own TopK/TopP warpers, applied to logits / T, then log-softmax: the same numbers."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    torch.manual_seed(top_k + int(100 * top_p))
    logits = torch.randn(3, 40, 1000, dtype=torch.float64) * 3
    probs = (logits / 0.7).softmax(-1).reshape(-1, 1000)
    labels = torch.multinomial(probs, 1).reshape(3, 40)
    got = sampling_log_probs(logits, labels, 0.7, SamplingFilter(top_k, top_p))

    scores = (logits / 0.7).reshape(-1, 1000)
    if top_k > 0:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    expected = scores.log_softmax(-1).gather(1, labels.reshape(-1, 1)).reshape(3, 40)
    assert torch.equal(torch.isneginf(got), torch.isneginf(expected))
    finite = ~torch.isneginf(expected)
    assert finite.any() and not finite.all()  # labels drawn untruncated: both kinds are compared
    torch.testing.assert_close(got[finite], expected[finite], rtol=0, atol=1e-12)


def test_ties_at_the_kth_value_are_kept_before_top_p():
    """Top-k keeps every token tied with the k-th value, so top-p then runs over more than k values (the sort of
    the whole row, not of the k largest): the same numbers as transformers' warpers. Rows 0-2 have 4 more tokens
    tied at the 20th value; top-p 0.6 cuts above the ties (a tie at the top-p cut would be broken by sort order)."""
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    torch.manual_seed(5)
    logits = torch.randn(6, 200, dtype=torch.float64)
    logits[:3, 10:14] = logits[:3].topk(20, dim=-1).values[:, -1:]
    labels = (logits / 0.9).softmax(-1).multinomial(1)[:, 0]
    got = sampling_log_probs(logits, labels, 0.9, SamplingFilter(20, 0.6))
    top_k = TopKLogitsWarper(20)(None, logits / 0.9)
    assert torch.isfinite(top_k).sum(-1).tolist() == [23, 24, 24, 20, 20, 20]
    expected = TopPLogitsWarper(0.6)(None, top_k).log_softmax(-1).gather(1, labels[:, None])[:, 0]
    assert torch.equal(torch.isneginf(got), torch.isneginf(expected))
    finite = ~torch.isneginf(expected)
    assert finite.any() and not finite.all()
    torch.testing.assert_close(got[finite], expected[finite], rtol=0, atol=1e-12)


def test_chunks_and_dtypes_do_not_change_the_numbers():
    torch.manual_seed(1)
    logits = torch.randn(2, 150, 300)  # 300 positions: several chunks of 64
    labels = torch.randint(0, 300, (2, 150))
    sampling = SamplingFilter(top_k=100, top_p=0.8)
    whole = torch.stack([sampling_log_probs(logits[b], labels[b], 1.3, sampling) for b in range(2)])
    assert whole.dtype == torch.float32
    torch.testing.assert_close(sampling_log_probs(logits, labels, 1.3, sampling), whole, rtol=0, atol=0)
    bf16 = sampling_log_probs(logits.bfloat16(), labels, 1.3, sampling)
    assert bf16.dtype == torch.float32  # upcast chunk by chunk, as the plain log-probs


@pytest.mark.parametrize(
    "top_k,top_p,name", [(0, 1.0, "top_k"), (-2, 1.0, "top_k"), (-1, 0.0, "top_p"), (-1, 1.5, "top_p")]
)
def test_bad_filters_are_value_errors(top_k, top_p, name):
    """The flags' rule is validation's (tests/ppo/test_validate.py); the filter only asserts it."""
    with pytest.raises(ValueError, match=f"^{name} must be"):
        SamplingFilter(top_k, top_p)


def test_importance_weights_compare_one_distribution():
    """On-policy under top-p, the engine reports truncated log-probs: against the plain ones every weight is the
    kept mass Z < 1; against the recomputed truncation every weight is 1. A token outside the trainer's support
    gets a weight of ~0 and is counted."""
    torch.manual_seed(2)
    logits = torch.randn(4, 10, 64, dtype=torch.float64) * 2
    labels = torch.multinomial(logits.reshape(-1, 64).softmax(-1), 1).reshape(4, 10)
    sampling = SamplingFilter(top_p=0.9)
    truncated = sampling_log_probs(logits, labels, 1.0, sampling)
    inside = ~torch.isneginf(truncated)
    mask = inside.double()  # the engine only samples inside its support
    engine = torch.where(inside, truncated, 0.0)  # what vLLM reports for its own samples
    plain = logits.log_softmax(-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)

    biased, _ = importance_weights(plain, engine, mask, "tis", (0.0, 10.0))
    assert (biased[inside] < 1 - 1e-3).all()  # the mismatch the recomputation removes
    weights, metrics = importance_weights(truncated, engine, mask, "tis", (0.0, 10.0))
    torch.testing.assert_close(weights[inside], torch.ones_like(weights[inside]), rtol=0, atol=1e-12)
    loss, pg = policy_loss(
        plain,
        plain,
        torch.ones_like(plain),
        mask,
        rollout_log_probs=engine,
        is_correction="tis",
        is_threshold=(0.0, 10.0),
        old_sampling_log_probs=truncated,
    )
    assert float(pg["is_ratio_mean"]) == pytest.approx(1.0, abs=1e-12)
    torch.testing.assert_close(loss, -mask)  # ratio 1, advantage 1, weight 1

    # one token the trainer's truncation excludes (e.g. the policy moved): weight ~0, counted as outside
    moved = truncated.clone()
    moved[0, 0] = float("-inf")
    weights, _ = importance_weights(moved, engine, mask, "tis", (0.0, 10.0))
    assert weights[0, 0] < 1e-8 and torch.isfinite(weights).all()
    gap = {k: float(v) for k, v in engine_gap(engine, moved, mask).items()}
    assert gap["outside_support"] == pytest.approx(1 / mask.sum().item())
    assert gap["logprob_diff"] == pytest.approx(0.0, abs=1e-12) and gap["logprob_diff_max"] == 0.0
    far = engine.clone()
    far[0, 1] += 0.3
    assert float(engine_gap(far, truncated, mask)["logprob_diff_max"]) == pytest.approx(0.3, abs=1e-6)


def test_a_token_outside_the_trainers_support_under_each_correction():
    """The default band (0.5, 5): the ratio of a token the trainer's truncation excludes is e^-20; tis raises it to
    the band's floor like any low ratio, icepop drops it, seq-mask-tis floors it unless the response's geometric
    mean leaves the band (the module docstring of `openppo.algorithms.sampling` says the same)."""
    rollout = torch.zeros(2, 100, dtype=torch.float64)  # log-probs the engine reported
    old = torch.zeros_like(rollout)  # the trainer agrees on every other token (ratio 1)
    old[:, 0] = float("-inf")  # the first token of each response is outside the trainer's support
    mask = torch.ones_like(rollout)
    mask[1, 10:] = 0  # the second response is 10 tokens long: its mean log-ratio is -20 / 10
    band = (0.5, 5.0)
    tis, _ = importance_weights(old, rollout, mask, "tis", band)
    icepop, _ = importance_weights(old, rollout, mask, "icepop", band)
    seq, _ = importance_weights(old, rollout, mask, "seq-mask-tis", band)
    assert tis[:, 0].tolist() == [0.5, 0.5] and tis[0, 1:].eq(1).all()
    assert icepop[:, 0].tolist() == [0.0, 0.0] and icepop[0, 1:].eq(1).all()
    # 100 tokens: exp(-20 / 100) = 0.82 is inside the band, the token is floored; 10 tokens: exp(-2) = 0.14 is not
    assert seq[0, 0] == 0.5 and seq[0, 1:].eq(1).all() and seq[1].eq(0).all()
