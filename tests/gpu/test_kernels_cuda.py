"""--use_liger_kernel on CUDA: the model with Liger's RMSNorm, RoPE and SwiGLU kernels (the real liger-kernel package,
which tests/gpu/run.sh installs), alone and with the LM head in chunks (--lm_head_chunk_tokens) under Liger's final
norm, gives the plain model's log-probs, entropy and gradients on packed rows (tests/models/test_kernels.py checks the
CPU side: the compiled layers against eager in fp32, where Liger's kernels go, and that Liger inside compiled layers
is refused)."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.conftest import requires_cuda

pytestmark = [pytest.mark.gpu, requires_cuda]

GROUPS = [(37, [12, 5, 40, 21]), (90, [33, 8]), (11, [64, 3, 17])]  # (prompt tokens, response tokens of each row)
CASES = [  # (dtype, atol, LM head chunk positions of both models (0: full logits))
    (torch.float32, 1e-4, 0),
    (torch.bfloat16, 3e-2, 0),
    (torch.bfloat16, 3e-2, 64),
]


def _scores(actor, batch):
    """Masked log-probs and entropy, and every gradient of a loss over both."""
    actor.train()
    mask = batch["action_mask"].float()
    out = actor(batch["sequences"], batch["attention_mask"], score_mask=batch["action_mask"], return_entropy=True)
    ((out.log_probs.float() + 0.1 * out.entropy.float()) * mask).sum().backward()
    grads = {n: p.grad.float() for n, p in actor.named_parameters()}
    return (out.log_probs.float() * mask).detach(), (out.entropy.float() * mask).detach(), grads


@pytest.mark.parametrize("dtype,atol,chunk", CASES, ids=["liger-fp32", "liger-bf16", "liger-chunked-bf16"])
def test_fused_models_score_as_the_plain_one(gpu_model_dir, monkeypatch, dtype, atol, chunk):
    from transformers.models.qwen2 import modeling_qwen2

    from openppo.models.actor import Actor
    from openppo.models.row_layout import RowLayout
    from tests.ppo.rank_helpers import grouped_rows

    # Liger replaces these in the transformers module itself (RoPE for every Qwen2 model of the process): put back after
    for name in ("apply_rotary_pos_emb", "Qwen2RMSNorm", "Qwen2MLP"):
        monkeypatch.setattr(modeling_qwen2, name, getattr(modeling_qwen2, name))
    batch = {k: v.cuda() for k, v in grouped_rows(GROUPS, seed=0).items()}
    results = []
    for liger in (False, True):  # the plain model first: Liger's RoPE would reach it too
        actor = Actor.from_pretrained(str(gpu_model_dir), dtype=dtype, use_liger_kernel=liger).cuda()
        actor.layout = RowLayout(packed=True)
        assert actor.chunk_head(chunk) is None  # both models alike: the comparison is Liger's alone
        layer = actor.hf_model.model.layers[0]
        assert (layer.mlp._get_name() == "LigerSwiGLUMLP") is liger, layer.mlp._get_name()
        assert ("forward" in vars(layer.input_layernorm)) is liger  # Liger's RMSNorm forward bound on the module
        assert ("forward" in vars(actor.hf_model.model.norm)) is liger  # the final norm, under the chunked head
        results.append(_scores(actor, batch))
    (lp, ent, grads), (o_lp, o_ent, o_grads) = results
    assert modeling_qwen2.apply_rotary_pos_emb.__module__.startswith("liger_kernel")
    torch.testing.assert_close(o_lp, lp, atol=atol, rtol=0)
    torch.testing.assert_close(o_ent, ent, atol=atol, rtol=0)
    for name, grad in grads.items():
        scale = max(grad.abs().max().item(), 1e-6)
        torch.testing.assert_close(o_grads[name] / scale, grad / scale, atol=10 * atol, rtol=0, msg=name)
