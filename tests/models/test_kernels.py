"""--use_liger_kernel (`openppo.models.kernels`): on CPU the model keeps transformers' modules and the run says so once;
on a GPU the model's own modules get Liger's kernels before LoRA wraps them.

Liger's patch functions import its Triton GPU kernels, which cannot load on a CPU-only machine: the GPU-side tests
stand a recording module in for `liger_kernel.transformers.monkey_patch` (the one mock here; the real package is
checked on CUDA by tests/gpu/test_kernels_cuda.py, log-probs and gradients against the plain model)."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from openppo.errors import UserError
from openppo.models.actor import Actor
from openppo.models.kernels import KERNELS, apply_liger, compile_layers, liger_notice
from tests.model_cache import tiny_model_dir

GROUPS = [(37, [12, 5, 40, 21]), (90, [33, 8]), (11, [64, 3, 17])]  # (prompt tokens, response tokens of each row)


def _stand_in(monkeypatch) -> list[dict]:
    """Liger's monkey_patch module as a recorder of the patch calls it gets; qwen2 is a model type it knows."""
    calls: list[dict] = []
    module = types.ModuleType("liger_kernel.transformers.monkey_patch")
    module.MODEL_TYPE_TO_APPLY_LIGER_FN = {"qwen2": None, "llama": None}
    module._apply_liger_kernel_to_instance = lambda model, **kwargs: calls.append({"model": model, **kwargs})
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", module)
    return calls


def test_on_cpu_the_model_is_left_as_it_is_and_the_run_says_so():
    assert liger_notice(True, on_gpu=False).startswith("--use_liger_kernel has no effect on CPU")
    assert liger_notice(True, on_gpu=True) is None and liger_notice(False, on_gpu=False) is None
    torch.manual_seed(0)
    seqs = torch.randint(10, 1000, (2, 12))
    plain = Actor.from_pretrained(str(tiny_model_dir()), dtype=torch.float32)
    liger = Actor.from_pretrained(str(tiny_model_dir()), dtype=torch.float32, use_liger_kernel=True)
    assert [type(m) for m in liger.modules()] == [type(m) for m in plain.modules()]
    assert not any("forward" in vars(m) for m in liger.modules())  # no forward bound on an instance
    mask = torch.ones_like(seqs)
    torch.testing.assert_close(liger(seqs, mask).log_probs, plain(seqs, mask).log_probs, atol=0, rtol=0)


def test_on_a_gpu_the_models_own_modules_get_the_kernels_before_lora(monkeypatch):
    calls = _stand_in(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    actor = Actor.from_pretrained(str(tiny_model_dir()), dtype=torch.float32, use_liger_kernel=True, lora_rank=4)
    assert len(calls) == 1 and {k: v for k, v in calls[0].items() if k != "model"} == KERNELS
    # the transformers model itself, before the adapters (Liger binds its forwards onto the modules LoRA then wraps)
    assert calls[0]["model"] is actor.hf_model and type(calls[0]["model"]).__name__ == "Qwen2ForCausalLM"
    assert KERNELS["fused_linear_cross_entropy"] is False  # RL needs per-token log-probs, not a mean loss


def test_liger_inside_compiled_layers_is_refused_before_the_model_changes(monkeypatch):
    calls = _stand_in(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(UserError, match=r"^--use_liger_kernel with --torch_compile: .* use one of the two"):
        Actor.from_pretrained(str(tiny_model_dir()), dtype=torch.float32, use_liger_kernel=True, torch_compile=True)
    assert not calls


def test_a_model_type_liger_lacks_is_named_and_a_missing_package_is_a_one_line_error(monkeypatch):
    calls = _stand_in(monkeypatch)
    model = types.SimpleNamespace(config=types.SimpleNamespace(model_type="gpt_neox"))
    assert apply_liger(model, on_gpu=True) == "Liger has no kernels for model type 'gpt_neox'" and not calls
    assert apply_liger(model, on_gpu=False) == "no GPU"
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.monkey_patch", None)  # not installed
    with pytest.raises(UserError, match=r"--use_liger_kernel needs the liger-kernel package .*requirements/gpu.txt"):
        apply_liger(model, on_gpu=True)


def test_compiled_layers_score_and_train_as_the_eager_ones():
    """LoRA and activation checkpointing under the compiled layers, five packed batches of different packings:
    log-probs and every gradient as eager (fp32, 1e-5) on each. The compiles stop: the packed rows' attention is opaque
    to the compiler (its bounds are Python ints, on which a traced layer would be specialised), so the layer breaks
    only there and its pieces turn dynamic in length; the last two packings compile nothing."""
    import random

    import torch._dynamo
    from torch._dynamo.utils import counters

    from openppo.models.row_layout import RowLayout
    from tests.ppo.rank_helpers import grouped_rows

    rng = random.Random(0)
    packings = [GROUPS] + [
        [(rng.randint(5, 60), [rng.randint(3, 40) for _ in range(rng.randint(1, 4))]) for _ in range(3)]
        for _ in range(4)
    ]
    batches = [grouped_rows(groups, seed=i) for i, groups in enumerate(packings)]
    results, graphs = [], []
    for compiled in (False, True):
        torch.manual_seed(0)  # (the same LoRA weights)
        actor = Actor.from_pretrained(
            str(tiny_model_dir()),
            dtype=torch.float32,
            lora_rank=4,
            gradient_checkpointing=True,
            torch_compile=compiled,
        ).train()
        actor.layout = RowLayout(packed=True)
        layers = actor.hf_model.model.layers
        assert all((layer._compiled_call_impl is not None) is compiled for layer in layers)
        torch._dynamo.reset()
        counters.clear()
        for batch in batches:
            actor.zero_grad()
            out = actor(batch["sequences"], batch["attention_mask"], score_mask=batch["action_mask"])
            (out.log_probs * batch["action_mask"]).sum().backward()
            grads = {n: p.grad.clone() for n, p in actor.named_parameters() if p.grad is not None}
            results.append((compiled, out.log_probs.detach(), grads))
            graphs.append(counters["stats"]["unique_graphs"])
    breaks = list(counters["graph_break"])
    assert breaks and all("varlen_attention_forward" in b for b in breaks), breaks
    assert graphs[-1] == graphs[-3] > 0, graphs  # (the eager pass compiled nothing: its counts are the first five)
    eager, compiled = results[: len(batches)], results[len(batches) :]
    for (_, lp, grads), (_, c_lp, c_grads) in zip(eager, compiled):
        assert grads.keys() == c_grads.keys() and len(grads) == 2 * 7 * len(layers)  # A and B of 7 linears a layer
        torch.testing.assert_close(c_lp, lp, atol=1e-5, rtol=0)
        for name, grad in grads.items():
            torch.testing.assert_close(c_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_every_model_kind_has_its_decoder_layers_compiled():
    from openppo.models.scalar import ScalarModel

    critic = ScalarModel.from_pretrained(str(tiny_model_dir()), dtype=torch.float32, flag="--critic_pretrain")
    assert compile_layers(critic.model) == critic.model.config.num_hidden_layers
    assert compile_layers(torch.nn.Linear(2, 2)) == 0


def test_the_compile_mode_reaches_every_layers_torch_compile():
    """`compile_layers(mode=)` (bench/train_step_mfu.py --compile_mode): reduce-overhead (CUDA graphs, which need a
    GPU to replay) is in every layer's Inductor settings, the default mode leaves them out. Read from each layer's
    compiled call, which compiles nothing until a forward."""
    model = Actor.from_pretrained(str(tiny_model_dir()), dtype=torch.float32).hf_model
    layers = model.model.layers
    assert compile_layers(model, mode="reduce-overhead") == len(layers)
    assert all(layer._compiled_call_impl.get_compiler_config()["triton.cudagraphs"] for layer in layers)
    assert compile_layers(model) == len(layers)
    assert not any(layer._compiled_call_impl.get_compiler_config()["triton.cudagraphs"] for layer in layers)


def test_a_zero2_step_of_the_compiled_layers_moves_the_weights_as_eager():
    """Under a real DeepSpeed ZeRO-2 engine (its gradient hooks, reduction buckets and partitioned fp32 copy), the
    compiled model's gradients are the eager model's (fp32, 1e-5), and so is its first optimizer step to a
    twentieth of the learning rate (Adam's first step divides each gradient by its own size, so a rounding
    difference in a near-zero gradient moves its weight by up to a few per cent of the rate)."""
    from deepspeed.utils import safe_get_full_grad

    from openppo.models.row_layout import RowLayout
    from openppo.strategy.config import DeepSpeedConfig
    from openppo.strategy.deepspeed_strategy import DeepSpeedStrategy
    from tests.ppo.rank_helpers import grouped_rows, train_engine

    batch = grouped_rows(GROUPS, seed=1)
    weights, grads = [], []
    for compiled in (False, True):
        strategy = DeepSpeedStrategy(
            DeepSpeedConfig(dist_timeout=120, zero_stage=2, param_dtype="fp32"),
            train_batch_size=1,
            micro_batch_size=1,
            max_norm=1.0,
            seed=0,
        )
        strategy.setup_distributed()
        actor = Actor.from_pretrained(str(tiny_model_dir()), dtype=torch.float32, torch_compile=compiled)
        actor.layout = RowLayout(packed=True)
        engine = train_engine(strategy, actor, lr=1e-3, steps=4)
        out = engine(batch["sequences"], batch["attention_mask"], score_mask=batch["action_mask"])
        engine.backward(-(out.log_probs * batch["action_mask"]).sum() / batch["action_mask"].sum())
        grads.append({n: safe_get_full_grad(p).clone() for n, p in actor.named_parameters()})
        engine.step()
        weights.append({n: p.detach().clone() for n, p in actor.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=1e-5, rtol=1e-4, msg=name)
    eager, compiled = weights
    apart = max((compiled[n] - p).abs().max().item() for n, p in eager.items())
    assert apart < 0.05 * 1e-3, apart  # measured 1.3e-5
    start = Actor.from_pretrained(str(tiny_model_dir()), dtype=torch.float32)
    assert max((eager[n] - p).abs().max().item() for n, p in start.named_parameters()) > 1e-4  # the step moved them
