"""Chunked log-probs and entropy match the plain full-vocabulary computation, values and gradients."""

import math

import pytest
import torch

from openppo.algorithms import entropy_from_logits, log_probs_and_entropy, log_probs_from_logits
from openppo.algorithms.entropy import CPU_CHUNK_BYTES, DEFAULT_CHUNK_SIZE, default_chunk_size


def _reference_log_probs(logits, labels, temperature):
    return torch.log_softmax(logits.double() / temperature, -1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def _reference_entropy(logits, temperature):
    logp = torch.log_softmax(logits.double() / temperature, -1)
    return -(logp.exp() * logp).sum(-1)


def test_default_chunk_is_cache_sized_on_cpu_only():
    # 4 MiB of fp32 logits: 21 positions of SmolLM2's 49152-token vocabulary, 6 of Qwen's 151936, at least 1
    assert CPU_CHUNK_BYTES == 4 << 20
    assert default_chunk_size(torch.empty(1, 1, 49152)) == 21
    assert default_chunk_size(torch.empty(1, 1, 151936)) == 6
    assert default_chunk_size(torch.empty(1, 1, 2_000_000)) == 1
    assert default_chunk_size(torch.empty(1, 1, 49152, device="meta")) == DEFAULT_CHUNK_SIZE  # not a CPU


def test_hand_values():
    # uniform over 4 tokens: log p = -ln 4, H = ln 4; temperature scales the logits first
    logits = torch.zeros(1, 1, 4)
    assert log_probs_from_logits(logits, torch.tensor([[2]])).item() == pytest.approx(-math.log(4))
    assert entropy_from_logits(logits).item() == pytest.approx(math.log(4))
    # logits [0, ln 3] at T = 1 -> p = [1/4, 3/4]; at T = 2 -> [0, ln 3 / 2] -> p = [1/(1+sqrt 3), sqrt 3/(1+sqrt 3)]
    logits = torch.tensor([[[0.0, math.log(3.0)]]])
    assert log_probs_from_logits(logits, torch.tensor([[1]])).item() == pytest.approx(math.log(0.75))
    p = math.sqrt(3) / (1 + math.sqrt(3))
    assert log_probs_from_logits(logits, torch.tensor([[1]]), 2.0).item() == pytest.approx(math.log(p))
    assert entropy_from_logits(logits, 2.0).item() == pytest.approx(-(p * math.log(p) + (1 - p) * math.log(1 - p)))


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 1024, None])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_reference_values_and_grads(chunk_size, dtype):
    torch.manual_seed(0)
    full = torch.randn(3, 6, 11, dtype=dtype)
    # a shifted slice: non-contiguous, must not be copied or mis-indexed
    logits = full[:, :-1].clone().requires_grad_(True)
    sliced = full.clone().requires_grad_(True)
    labels = torch.randint(0, 11, (3, 5))
    g_lp = torch.randn(3, 5, dtype=dtype)
    g_h = torch.randn(3, 5, dtype=dtype)
    lp = log_probs_from_logits(sliced[:, :-1], labels, 0.7, chunk_size=chunk_size)
    h = entropy_from_logits(sliced[:, :-1], 0.7, chunk_size=chunk_size)
    assert lp.dtype == dtype and h.dtype == dtype
    ((lp * g_lp).sum() + (h * g_h).sum()).backward()
    ref_lp = _reference_log_probs(logits, labels, 0.7)
    ref_h = _reference_entropy(logits, 0.7)
    ((ref_lp * g_lp).sum() + (ref_h * g_h).sum()).backward()
    torch.testing.assert_close(lp, ref_lp.to(dtype))
    torch.testing.assert_close(h, ref_h.to(dtype))
    torch.testing.assert_close(sliced.grad[:, :-1], logits.grad)
    assert (sliced.grad[:, -1] == 0).all()


def test_gradcheck_fp64():
    torch.manual_seed(1)
    logits = torch.randn(2, 3, 5, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 5, (2, 3))
    assert torch.autograd.gradcheck(lambda x: log_probs_from_logits(x, labels, 1.3, chunk_size=2), (logits,))
    assert torch.autograd.gradcheck(lambda x: entropy_from_logits(x, 1.3, chunk_size=2), (logits,))


def test_banned_tokens_and_2d_input():
    # a logit of -inf (banned token) has p = 0: entropy and its gradient stay finite and equal the 3-token case
    logits = torch.tensor([[0.5, -1.0, 2.0, float("-inf")]], requires_grad=True)
    h = entropy_from_logits(logits)
    h.sum().backward()
    kept = torch.tensor([[0.5, -1.0, 2.0]], requires_grad=True)
    ref = _reference_entropy(kept, 1.0)
    ref.sum().backward()
    assert h.shape == (1,)
    torch.testing.assert_close(h, ref.float())
    torch.testing.assert_close(logits.grad[:, :3], kept.grad)
    assert logits.grad[0, 3] == 0


def test_bf16_logits_give_fp32_results_and_bf16_grads():
    torch.manual_seed(2)
    logits = torch.randn(2, 4, 9).to(torch.bfloat16).requires_grad_(True)
    labels = torch.randint(0, 9, (2, 4))
    lp = log_probs_from_logits(logits, labels, chunk_size=3)
    assert lp.dtype == torch.float32
    lp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    torch.testing.assert_close(lp, _reference_log_probs(logits.float(), labels, 1.0).float(), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        entropy_from_logits(logits, 0.0)


def test_backward_keeps_no_fp32_copy():
    # autograd must save only what exists anyway (the bf16 logits, labels, the [B, T] entropy), never a
    # full-vocabulary fp32 softmax
    logits = torch.randn(2, 8, 64).to(torch.bfloat16).requires_grad_(True)
    labels = torch.randint(0, 64, (2, 8))
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        log_probs_from_logits(logits, labels, chunk_size=4)
        entropy_from_logits(logits, chunk_size=4)
    logits_bytes = logits.numel() * logits.element_size()
    assert sum(saved) <= 2 * logits_bytes + labels.numel() * 8 + 2 * 8 * 4


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_log_probs_and_entropy_equal_the_separate_functions(temperature, dtype):
    gen = torch.Generator().manual_seed(3)
    logits = (3 * torch.randn(2, 5, 40, generator=gen)).to(dtype)
    logits[0, 1, 7] = float("-inf")  # a banned token: contributes nothing to the entropy, no NaN
    labels = torch.randint(0, 40, (2, 5), generator=gen)
    leaf = logits.clone().requires_grad_()
    log_probs, entropy = log_probs_and_entropy(leaf, labels, temperature, chunk_size=3)
    assert not entropy.requires_grad and torch.isfinite(entropy).all()
    ref = log_probs_from_logits(logits.float(), labels, temperature)
    z = logits.float() / temperature
    p = z.softmax(-1)
    ref_entropy = -torch.special.xlogy(p, p).sum(-1)  # the definition, computed directly
    assert torch.allclose(log_probs, ref, atol=1e-5) and torch.allclose(entropy, ref_entropy, atol=1e-5)
    assert torch.allclose(entropy, entropy_from_logits(logits, temperature), atol=1e-5)
    log_probs.sum().backward()
    x = logits.double().requires_grad_()
    _reference_log_probs(x, labels, temperature).sum().backward()
    assert torch.allclose(leaf.grad.double(), x.grad, atol=1e-2 if dtype == torch.bfloat16 else 1e-6)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 5e-5), (torch.bfloat16, 1e-4)], ids=["fp32", "bf16"])
def test_the_compiled_chunks_give_the_eager_values_and_gradients(dtype, atol):
    """--torch_compile compiles each chunk's math (openppo.algorithms.entropy._compiled): the same log-probs,
    entropy and logits' gradient as eager, with chunks of two shapes (the last one shorter) and a temperature.
    The compiled kernels sum over the vocabulary in another order: entropies of ~2 nats 1.9e-6 apart with
    PyTorch's AVX512 kernels, 1.24e-5 with its AVX2 ones (docs/platform.md), hence 5e-5 in fp32."""
    torch.manual_seed(0)
    logits = (torch.randn(2, 7, 50) * 3).to(dtype)
    labels = torch.randint(0, 50, (2, 7))
    weights = torch.randn(2, 7)
    results = []
    for compiled in (False, True):
        x = logits.clone().requires_grad_(True)
        lp, ent = log_probs_and_entropy(x, labels, 0.7, chunk_size=4, compiled=compiled)
        (lp * weights).sum().backward()
        only = log_probs_from_logits(logits, labels, 0.7, chunk_size=4, compiled=compiled)
        results.append((lp.detach(), ent, x.grad.float(), only))
    (lp, ent, grad, only), (clp, cent, cgrad, conly) = results
    assert grad.dtype == torch.float32 and lp.dtype == torch.float32
    for eager, compiled in ((lp, clp), (ent, cent), (grad, cgrad), (only, conly)):
        assert torch.allclose(eager, compiled, atol=atol, rtol=0), (eager - compiled).abs().max()
