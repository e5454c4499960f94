"""Shared-prompt rows (--share_prompt_in_group) against plain packed rows: the same numbers, fewer tokens.

Three groups in one batch, with prompts of 5, 9 and 3 tokens and 3, 2 and 4 responses of 1-7 tokens, on the zoo's
tiny Qwen2, Llama and Qwen3 in fp32. The shared row holds each prompt once (50 tokens instead of 86). Log-probs,
entropy, a scalar model's values and every parameter's gradient of a loss over them must equal the packed
computation to 1e-5; LoRA adapters and gradient checkpointing included. The GPU's FlexAttention path runs here
forward only (FlexAttention has no CPU backward); tests/gpu checks its gradients.
"""

from __future__ import annotations

import pytest
import torch

from openppo.models.actor import Actor, prompt_lengths
from openppo.models.row_layout import RowLayout, SharedPrompts
from openppo.models.scalar import ScalarModel
from tests.model_cache import tiny_model_dir
from tests.ppo.rank_helpers import grouped_rows

GROUPS = [(5, [4, 1, 7]), (9, [3, 6]), (3, [2, 5, 1, 4])]  # (prompt tokens, response tokens of each row)
TOL = 1e-5


def _batch() -> dict[str, torch.Tensor]:
    return grouped_rows(GROUPS, seed=0)


def test_the_row_holds_each_prompt_once_at_its_own_positions():
    b = _batch()
    shared = SharedPrompts.pack(b["sequences"], b["attention_mask"], prompt_lengths(b["action_mask"]))
    assert shared.input_ids.size(1) == sum(p + sum(r) for p, r in GROUPS) == 50  # packed: 86
    assert len(shared.prompts) == 3 and len(shared.responses) == 9
    grid = shared.grid_index
    real = b["attention_mask"].bool()
    assert torch.equal(shared.input_ids[0, grid[real]], b["sequences"][real])  # every token comes back
    positions = b["attention_mask"].cumsum(-1) - 1
    assert torch.equal(shared.position_ids[0, grid[real]], positions[real])  # at its unshared position
    assert (grid[~real] == -1).all()
    # rows of another prompt (or of another length) never share: a group ends where the prompt changes
    assert grid[0, 4] == grid[2, 4] != grid[3, 4]


def _actor(arch: str, **build) -> Actor:
    path = tiny_model_dir() if arch == "qwen2" else tiny_model_dir(arch=arch)
    return Actor.from_pretrained(str(path), dtype=torch.float32, **build)


def _actor_outputs(actor: Actor, b: dict, shared: bool) -> tuple[dict, dict]:
    """Log-probs and entropy, and the gradients of a loss over both, in a packed or shared-prompt layout."""
    actor.layout = RowLayout(packed=True, share_prompts=shared)
    actor.zero_grad()
    out = actor(b["sequences"], b["attention_mask"], return_entropy=True, score_mask=b["action_mask"])
    weights = torch.linspace(-1, 1, out.log_probs.numel()).view_as(out.log_probs)  # a loss that weighs every token
    ((out.log_probs * weights + 0.1 * out.entropy) * b["action_mask"]).sum().backward()
    grads = {n: p.grad.clone() for n, p in actor.named_parameters() if p.requires_grad}
    mask = b["action_mask"].bool()
    return {"log_probs": out.log_probs[mask].detach(), "entropy": out.entropy[mask].detach()}, grads


@pytest.mark.parametrize(
    "arch,build",
    [
        ("qwen2", {}),
        ("llama", {}),
        ("qwen3", {}),
        ("qwen2", {"lora_rank": 4, "lora_alpha": 8}),
        ("qwen2", {"gradient_checkpointing": True}),
    ],
    ids=["qwen2", "llama", "qwen3", "qwen2-lora", "qwen2-checkpointing"],
)
def test_actor_log_probs_entropy_and_gradients_equal_the_packed_ones(arch, build):
    actor = _actor(arch, **build)
    actor.train()
    b = _batch()
    packed, packed_grads = _actor_outputs(actor, b, shared=False)
    shared, shared_grads = _actor_outputs(actor, b, shared=True)
    for key in packed:
        assert (packed[key] - shared[key]).abs().max() < TOL, key
    assert packed_grads.keys() == shared_grads.keys() and packed_grads
    scale = max(g.abs().max().item() for g in packed_grads.values())
    worst = max((packed_grads[n] - shared_grads[n]).abs().max().item() for n in packed_grads)
    assert worst < TOL * max(scale, 1.0), (worst, scale)


def test_scalar_model_values_and_gradients_equal_the_packed_ones():
    model = ScalarModel.from_pretrained(str(tiny_model_dir()), dtype=torch.float32, flag="--critic_pretrain")
    b = _batch()
    prompts = prompt_lengths(b["action_mask"])
    results = {}
    for shared in (False, True):
        model.layout = RowLayout(packed=True, share_prompts=shared)
        model.zero_grad()
        values = model(b["sequences"], b["attention_mask"], prompt_lens=prompts)
        (values * b["attention_mask"]).square().sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results[shared] = (values * b["attention_mask"]).detach(), grads
    assert (results[False][0] - results[True][0]).abs().max() < TOL
    worst = max((results[False][1][n] - results[True][1][n]).abs().max().item() for n in results[False][1])
    assert worst < TOL * max(1.0, max(g.abs().max().item() for g in results[False][1].values()))


def test_the_flex_attention_path_gives_the_packed_forward(monkeypatch):
    """The GPU path: the whole shared row in one FlexAttention call under the block mask, here on CPU with no
    gradient. A mask that let a response see another response of its group would change the log-probs.

    FlexAttention runs eagerly here (its reference implementation, with the same block mask and mask rule): no CPU run
    compiles it, and inductor's CPU kernel for it is box-dependent (9.6 s on one AVX-512 box, 18.7 s under AVX2 caps
    on an Intel Xeon, still running after 17 minutes under the same caps on an AMD EPYC). The compiled kernel that
    runs is the GPU's, checked by tests/gpu/test_shared_prompts_cuda.py."""
    from openppo.models import varlen_attention

    actor = _actor("qwen2").eval()
    b = _batch()
    mask = b["action_mask"].bool()
    results = {}
    for name, shared, flex_devices in [("packed", False, ()), ("flex", True, ("cpu",))]:
        monkeypatch.setattr(varlen_attention, "FLEX_DEVICES", flex_devices)
        actor.layout = RowLayout(packed=True, share_prompts=shared)
        with torch.no_grad(), torch.compiler.set_stance("force_eager"):
            out = actor(b["sequences"], b["attention_mask"], return_entropy=True, score_mask=b["action_mask"])
        results[name] = torch.cat([out.log_probs[mask], out.entropy[mask]])
    assert varlen_attention._SHARED._block_mask is not None  # the flex path ran
    assert (results["packed"] - results["flex"]).abs().max() < TOL
