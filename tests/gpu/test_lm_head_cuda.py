"""The LM head in chunks (--lm_head_chunk_tokens) on CUDA against the model's full logits: log-probs, entropy and
every gradient, in fp32 and bf16, packed rows (tests/models/test_lm_head.py is the CPU fp32 check)."""

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
    for chunk in (0, 64):
        assert actor.chunk_head(chunk) is None
        actor.zero_grad()
        out = actor(b["sequences"], b["attention_mask"], score_mask=b["action_mask"], return_entropy=True)
        ((out.log_probs.float() + 0.1 * out.entropy.float()) * mask).sum().backward()
        grads = {n: p.grad.float().clone() for n, p in actor.named_parameters()}
        results.append(((out.log_probs.float() * mask).detach(), (out.entropy.float() * mask).detach(), grads))
    (lp, ent, grads), (c_lp, c_ent, c_grads) = results
    torch.testing.assert_close(c_lp, lp, atol=atol, rtol=0)
    torch.testing.assert_close(c_ent, ent, atol=atol, rtol=0)
    for name, grad in grads.items():
        scale = max(grad.abs().max().item(), 1e-6)
        torch.testing.assert_close(c_grads[name] / scale, grad / scale, atol=10 * atol, rtol=0, msg=name)
