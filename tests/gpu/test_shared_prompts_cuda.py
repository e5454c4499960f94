"""Shared-prompt rows on CUDA: the FlexAttention path (one compiled call under a block mask) against plain packed
rows, log-probs and every gradient, in fp32 and bf16."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.conftest import requires_cuda

pytestmark = [pytest.mark.gpu, requires_cuda]

GROUPS = [(37, [12, 5, 40, 21]), (90, [33, 8]), (11, [64, 3, 17])]  # (prompt tokens, response tokens of each row)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)], ids=["fp32", "bf16"])
def test_flex_shared_rows_match_packed_rows(gpu_model_dir, dtype, atol):
    from openppo.models import varlen_attention
    from openppo.models.actor import Actor, prompt_lengths
    from openppo.models.row_layout import RowLayout
    from tests.ppo.rank_helpers import grouped_rows

    assert "cuda" in varlen_attention.FLEX_DEVICES
    actor = Actor.from_pretrained(str(gpu_model_dir), dtype=dtype).cuda()
    actor.train()
    b = {k: v.cuda() for k, v in grouped_rows(GROUPS, seed=0).items()}
    assert prompt_lengths(b["action_mask"]).tolist()[:4] == [37] * 4
    mask = b["action_mask"].float()
    results = []
    for shared in (False, True):
        actor.zero_grad()
        actor.layout = RowLayout(packed=True, share_prompts=shared)
        out = actor(b["sequences"], b["attention_mask"], score_mask=b["action_mask"]).log_probs
        (out.float() * mask).sum().backward()
        grads = {n: p.grad.float().clone() for n, p in actor.named_parameters()}
        results.append(((out.float() * mask).detach(), grads))
    assert varlen_attention._SHARED is not None and varlen_attention._SHARED._block_mask is not None
    (packed, packed_grads), (flex, flex_grads) = results
    torch.testing.assert_close(flex, packed, atol=atol, rtol=0)
    for name, grad in packed_grads.items():
        scale = max(grad.abs().max().item(), 1e-6)
        torch.testing.assert_close(flex_grads[name] / scale, grad / scale, atol=10 * atol, rtol=0, msg=name)
