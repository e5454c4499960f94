"""The LM head in chunks (--lm_head_chunk_tokens) on CUDA against the model's full logits: log-probs, entropy and
every gradient, in fp32 and bf16, packed rows, eager and with --torch_compile's compiled chunk math
(tests/models/test_lm_head.py is the CPU fp32 check)."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.conftest import requires_cuda

pytestmark = [pytest.mark.gpu, requires_cuda]

GROUPS = [(37, [12, 5, 40, 21]), (90, [33, 8]), (11, [64, 3, 17])]  # (prompt tokens, response tokens of each row)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"])
def test_chunked_head_matches_the_full_logits(gpu_model_dir, dtype, atol):
    from openppo.models.actor import Actor
    from openppo.models.row_layout import RowLayout
    from tests.ppo.rank_helpers import grouped_rows

    actor = Actor.from_pretrained(str(gpu_model_dir), dtype=dtype).cuda()
    actor.train()
    actor.layout = RowLayout(packed=True)
    b = {k: v.cuda() for k, v in grouped_rows(GROUPS, seed=0).items()}
    mask = b["action_mask"].float()
    results = []
    for chunk, compiled in ((0, False), (64, False), (64, True)):  # full logits, chunked, chunked + compiled math
        assert actor.chunk_head(chunk) is None
        actor.compiled_scoring = compiled
        actor.zero_grad()
        out = actor(b["sequences"], b["attention_mask"], score_mask=b["action_mask"], return_entropy=True)
        ((out.log_probs.float() + 0.1 * out.entropy.float()) * mask).sum().backward()
        grads = {n: p.grad.float().clone() for n, p in actor.named_parameters()}
        results.append(((out.log_probs.float() * mask).detach(), (out.entropy.float() * mask).detach(), grads))
    (lp, ent, grads) = results[0]
    for c_lp, c_ent, c_grads in results[1:]:
        torch.testing.assert_close(c_lp, lp, atol=atol, rtol=0)
        torch.testing.assert_close(c_ent, ent, atol=atol, rtol=0)
        for name, grad in grads.items():
            scale = max(grad.abs().max().item(), 1e-6)
            torch.testing.assert_close(c_grads[name] / scale, grad / scale, atol=10 * atol, rtol=0, msg=name)


def _chunk_math(device: str, compiled: bool):
    """Log-probs, entropy and the logits' gradient of bf16 logits over the Qwen3 vocabulary's 151,936 entries, in
    chunks of 256 positions (the last shorter), at a sampling temperature."""
    from openppo.algorithms import log_probs_and_entropy

    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(2, 300, 151_936, generator=gen) * 4).to(torch.bfloat16).to(device).requires_grad_(True)
    labels = torch.randint(0, 151_936, (2, 300), generator=gen).to(device)
    weights = torch.randn(2, 300, generator=gen).to(device)
    lp, ent = log_probs_and_entropy(logits, labels, 0.8, chunk_size=256, compiled=compiled)
    (lp * weights).sum().backward()
    return lp.detach(), ent, logits.grad.float()


def test_compiled_log_prob_chunks_match_eager():
    """--torch_compile's compiled chunk math (openppo.algorithms.entropy) on CUDA: Triton kernels where the CPU suite
    checks the CPU compiler's (tests/algorithms/test_algo_entropy.py). Sums over the vocabulary in another order
    (on CPU: log-probs 8e-6, entropy 9e-5 apart), and the gradient in bf16 (within one rounding step)."""
    eager, compiled = _chunk_math("cuda", False), _chunk_math("cuda", True)
    for a, b, atol, rtol in zip(eager, compiled, (1e-4, 5e-4, 1e-5), (0, 0, 2**-7)):
        torch.testing.assert_close(b, a, atol=atol, rtol=rtol)
