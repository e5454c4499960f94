"""Packed rows on CUDA: bf16 runs PyTorch's flash sdpa kernel per packed sequence; the log-probs and their
gradients must match the padded batch's (the same model, the same rows)."""

from __future__ import annotations

import pytest
import torch

from tests.gpu.conftest import requires_cuda

pytestmark = [pytest.mark.gpu, requires_cuda]


def _batch(vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    seqs = torch.randint(100, vocab - 100, (6, 80), generator=g)
    attn = torch.ones_like(seqs)
    for row, length in enumerate([80, 33, 64, 17, 71, 48]):
        attn[row, length:] = 0
    return seqs.cuda(), attn.cuda()


@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 3e-2), (torch.float32, 1e-4)], ids=["bf16", "fp32"])
def test_packed_rows_match_padded_rows(gpu_model_dir, dtype, atol):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from openppo.models.actor import Actor
    from openppo.models.row_layout import RowLayout

    actor = Actor.from_pretrained(str(gpu_model_dir), dtype=dtype).cuda()
    seqs, attn = _batch(actor.config.vocab_size)
    mask = attn[:, 1:].float()
    results = []
    for pack in (False, True):
        actor.zero_grad()
        actor.layout = RowLayout(packed=pack)
        if pack and dtype == torch.bfloat16:
            # the packed sequences attend without a mask: flash must be able to take every call
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                out = actor(seqs, attn).log_probs
        else:
            out = actor(seqs, attn).log_probs
        (out.float() * mask).sum().backward()
        grad = actor.model.get_input_embeddings().weight.grad.float().clone()
        results.append(((out.float() * mask).detach(), grad))
    (padded, padded_grad), (packed, packed_grad) = results
    torch.testing.assert_close(packed, padded, atol=atol, rtol=0)
    scale = padded_grad.abs().max()
    torch.testing.assert_close(packed_grad / scale, padded_grad / scale, atol=10 * atol, rtol=0)


@pytest.mark.parametrize("dtype,rel", [(torch.bfloat16, 5e-2), (torch.float32, 1e-3)], ids=["bf16", "fp32"])
def test_reward_model_scores_on_cuda_as_on_cpu(gpu_model_dir, dtype, rel):
    """The critic's and reward model's `ScalarModel` (whose CUDA runs no other test reaches: `serve_rm` and the
    reward and critic ranks on GPUs): its last-token scores on CUDA, padded and packed, against the same weights in
    fp32 on the CPU."""
    import copy

    from openppo.models.row_layout import RowLayout
    from openppo.models.scalar import ScalarModel

    torch.manual_seed(0)  # (the value head is new: random, the same in both copies)
    cpu = ScalarModel.from_pretrained(str(gpu_model_dir), dtype=torch.float32, flag="--reward_pretrain").eval()
    gpu = copy.deepcopy(cpu).to(device="cuda", dtype=dtype)
    seqs, attn = _batch(cpu.config.vocab_size)
    with torch.no_grad():
        reference = cpu.score_last(seqs.cpu(), attn.cpu())
        scale = reference.abs().max()
        for pack in (False, True):
            gpu.layout = RowLayout(packed=pack)
            scores = gpu.score_last(seqs, attn)
            assert scores.dtype == torch.float32 and scores.shape == (6,)
            torch.testing.assert_close(scores.cpu() / scale, reference / scale, atol=rel, rtol=0)
