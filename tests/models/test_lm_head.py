"""--lm_head_chunk_tokens (openppo/models/lm_head.py) against the model's own full logits, in process, fp32 on CPU:
log-probs, entropy (with gradient and for logging), the engine-truncated log-probs, a mixture of experts' router loss
and every parameter's gradient of a loss over them must agree to 1e-5, in every row layout (padded with the prompt
skipped, packed, shared prompts), with LoRA, tied and untied heads, and chunks that split rows (3 positions). The
bf16 check on a GPU is in tests/gpu/. A model whose logits are more than its head's output keeps the full path."""

from __future__ import annotations

import pytest
import torch

from openppo.algorithms import SamplingFilter
from openppo.models.actor import Actor
from openppo.models.lm_head import head_scores, unsupported_reason
from openppo.models.row_layout import RowLayout
from tests.model_cache import tiny_model_dir
from tests.ppo.rank_helpers import grouped_rows

GROUPS = [(5, [4, 1, 7]), (9, [3, 6]), (3, [2, 5, 1, 4])]  # (prompt tokens, response tokens of each row)
TOL = 1e-5
CHUNK = 3  # positions a chunk: most chunks straddle two rows' tokens


def _outputs(actor: Actor, b: dict, chunk: int, *, entropy, sampling=None, aux=False) -> tuple[dict, dict]:
    actor.chunk_head(chunk)
    actor.zero_grad()
    out = actor(
        b["sequences"],
        b["attention_mask"],
        return_entropy=entropy,
        score_mask=b["action_mask"],
        sampling=sampling,
        return_aux_loss=aux,
        temperature=0.7,
    )
    weights = torch.linspace(-1, 1, out.log_probs.numel()).view_as(out.log_probs)  # a loss that weighs every token
    loss = (out.log_probs * weights * b["action_mask"]).sum()
    if entropy is True:
        loss = loss + 0.1 * (out.entropy * b["action_mask"]).sum()
    if aux:
        loss = loss + out.aux_loss
    loss.backward()
    mask = b["action_mask"].bool()
    values = {"log_probs": out.log_probs[mask].detach()}
    if entropy:
        values["entropy"] = out.entropy[mask].detach()
    if sampling is not None:
        values["sampling"] = out.sampling_log_probs[mask]
    if aux:
        values["aux"] = out.aux_loss.detach().reshape(1)
    return values, {n: p.grad.clone() for n, p in actor.named_parameters() if p.requires_grad}


def _assert_same(full, chunked):
    (values, grads), (c_values, c_grads) = full, chunked
    assert values.keys() == c_values.keys()
    for key in values:
        finite = torch.isfinite(values[key])
        assert torch.equal(finite, torch.isfinite(c_values[key])), key  # (-inf outside the engine's truncation)
        assert (values[key][finite] - c_values[key][finite]).abs().max() < TOL, key
    assert grads.keys() == c_grads.keys() and grads
    scale = max(g.abs().max().item() for g in grads.values())
    worst = max((grads[n] - c_grads[n]).abs().max().item() for n in grads)
    assert worst < TOL * max(scale, 1.0), (worst, scale)


@pytest.mark.parametrize(
    "arch,build,layout,entropy",
    [
        ("qwen2", {}, "padded", True),
        ("qwen2", {}, "packed", "log"),
        ("qwen2", {}, "shared", True),
        ("llama", {}, "packed", True),
        ("qwen2", {"lora_rank": 4, "lora_alpha": 8}, "shared", "log"),
        ("qwen2", {"gradient_checkpointing": True}, "padded", False),
    ],
    ids=["padded", "packed", "shared", "llama-untied", "lora-shared", "checkpointing"],
)
def test_chunked_head_equals_the_full_logits(arch, build, layout, entropy):
    path = tiny_model_dir() if arch == "qwen2" else tiny_model_dir(arch=arch)
    actor = Actor.from_pretrained(str(path), dtype=torch.float32, **build)
    actor.train()
    actor.layout = RowLayout(packed=layout != "padded", share_prompts=layout == "shared")
    b = grouped_rows(GROUPS, seed=0)
    sampling = SamplingFilter(top_k=-1, top_p=0.9) if layout != "padded" else None
    full = _outputs(actor, b, 0, entropy=entropy, sampling=sampling)
    chunked = _outputs(actor, b, CHUNK, entropy=entropy, sampling=sampling)
    _assert_same(full, chunked)


def test_a_mixture_of_experts_keeps_its_router_loss():
    actor = Actor.from_pretrained(str(tiny_model_dir(arch="qwen3_moe")), dtype=torch.float32)
    actor.train()
    b = grouped_rows(GROUPS, seed=1)
    for layout in (RowLayout(), RowLayout(packed=True, share_prompts=True)):
        actor.layout = layout
        _assert_same(_outputs(actor, b, 0, entropy=False, aux=True), _outputs(actor, b, CHUNK, entropy=False, aux=True))


def test_head_scores_on_raw_hidden_states_without_gradient():
    """Scoring under no_grad (the old-log-prob and reference passes) takes the plain loop: same numbers."""
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50, bias=False)
    hidden, labels = torch.randn(2, 7, 8), torch.randint(0, 50, (2, 7))
    expected = torch.log_softmax(head(hidden), -1).gather(-1, labels[..., None])[..., 0]
    with torch.no_grad():
        log_probs, entropy, behaviour = head_scores(hidden, head, labels, 1.0, chunk_tokens=4, entropy="log")
    assert log_probs.shape == labels.shape and (log_probs - expected).abs().max() < 1e-6
    p = torch.softmax(head(hidden), -1)
    assert (entropy + (p * p.log()).sum(-1)).abs().max() < 1e-5
    assert behaviour is None
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1"):
        head_scores(hidden, head, labels, 1.0, chunk_tokens=0)


def test_the_compiled_chunk_math_gives_the_eager_values_and_gradients():
    """--torch_compile: the chunks' math after the head's matmul compiled (`openppo.algorithms.entropy.chunk_scores`
    and `chunk_gradient`, as the full path's), the same log-probs, logged entropy and gradients of the hidden
    states, weight and bias as eager, with a short last chunk and a temperature (fp32 5e-5: the compiled kernels sum
    the vocabulary in another order, tests/algorithms/test_algo_entropy.py)."""
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 50)
    hidden, labels = torch.randn(2, 7, 8) * 2, torch.randint(0, 50, (2, 7))
    weights = torch.randn(2, 7)
    results = []
    for compiled in (False, True):
        head.zero_grad()
        x = hidden.clone().requires_grad_(True)
        log_probs, entropy, _ = head_scores(x, head, labels, 0.7, chunk_tokens=4, entropy="log", compiled=compiled)
        (log_probs * weights).sum().backward()
        results.append((log_probs.detach(), entropy, x.grad, head.weight.grad.clone(), head.bias.grad.clone()))
    expected = torch.log_softmax(head(hidden) / 0.7, -1).gather(-1, labels[..., None])[..., 0]
    assert (results[0][0] - expected).abs().max() < 1e-6
    for eager, compiled in zip(*results):
        assert torch.allclose(eager, compiled, atol=5e-5, rtol=0), (eager - compiled).abs().max()


def test_a_model_that_transforms_its_logits_keeps_the_full_path():
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8, final_logit_softcapping=30.0,
    )  # fmt: skip
    actor = Actor(Gemma2ForCausalLM(config))
    why = actor.chunk_head(CHUNK)
    assert "final_logit_softcapping=30.0" in why and actor.head_chunk_tokens == 0
    assert unsupported_reason(Actor.from_pretrained(str(tiny_model_dir()), dtype=torch.float32).hf_model) is None
