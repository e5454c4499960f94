"""Model and optimizer build options that OpenRLHF recipes pass: LoRA targets, reentrant checkpointing, Adam eps."""

from __future__ import annotations

import torch

from openppo.models.actor import Actor
from openppo.models.hf import apply_lora
from tests.model_cache import tiny_model_dir
from tests.ppo.rank_helpers import train_engine


def _adapted(target_modules):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir(), dtype=torch.float32)
    peft = apply_lora(model, rank=4, alpha=8, dropout=0.0, target_modules=target_modules, task_type="CAUSAL_LM")
    return sorted(n for n, _ in peft.named_modules() if n.endswith(".lora_A"))


def test_all_linear_named_in_a_list_is_the_default():
    """`--target_modules all-linear` (OpenRLHF's default, spelled out in its recipes) adapts what no flag does."""
    default = _adapted(None)
    assert default and _adapted(["all-linear"]) == default
    assert _adapted(["q_proj"]) == [n for n in default if ".q_proj." in n]


def _grads(**build) -> tuple[dict[str, torch.Tensor], list]:
    torch.manual_seed(0)
    actor = Actor.from_pretrained(str(tiny_model_dir()), dtype=torch.float32, **build).train()
    seqs = torch.randint(10, 1000, (2, 12))
    actor(seqs, torch.ones_like(seqs)).log_probs.sum().backward()
    calls = [m._gradient_checkpointing_func for m in actor.modules() if hasattr(m, "_gradient_checkpointing_func")]
    return {n: p.grad for n, p in actor.named_parameters() if p.grad is not None}, calls


def test_reentrant_checkpointing_is_used_and_gives_the_same_gradients():
    """--gradient_checkpointing_use_reentrant picks torch's reentrant checkpoint; the gradients stay the plain ones."""
    plain, _ = _grads()
    for reentrant in (False, True):
        grads, calls = _grads(gradient_checkpointing=True, reentrant_checkpointing=reentrant)
        assert calls and all(c.keywords["use_reentrant"] is reentrant for c in calls)
        assert grads.keys() == plain.keys()
        assert max((grads[n] - plain[n]).abs().max().item() for n in plain) < 1e-5


def _engine(dtype: torch.dtype, eps: float = 1e-8, **ds):
    """A real 1-rank DeepSpeed training engine of the tiny actor with the DeepSpeed options `ds`."""
    from openppo.strategy.config import DeepSpeedConfig
    from openppo.strategy.deepspeed_strategy import DeepSpeedStrategy

    strategy = DeepSpeedStrategy(
        DeepSpeedConfig(dist_timeout=120, **ds), train_batch_size=2, micro_batch_size=1, max_norm=1.0, seed=0
    )
    strategy.setup_distributed()
    return train_engine(strategy, Actor.from_pretrained(str(tiny_model_dir()), dtype=dtype), lr=1e-4, steps=4, eps=eps)


def test_adam_eps_reaches_the_optimizer():
    engine = _engine(torch.float32, eps=1e-6, zero_stage=0, param_dtype="fp32")
    assert {g["eps"] for g in engine.optimizer.param_groups} == {1e-6}


def test_adam_eps_and_reentrant_flags_reach_the_build_arguments():
    from openppo.config.schema import parse_config
    from openppo.ppo.config import PPOConfig
    from openppo.ppo.workers import _optimizer_kwargs
    from openppo.trainers import setup
    from openppo.trainers.configs import SFTConfig

    argv = "--adam_eps 1e-6 --gradient_checkpointing --gradient_checkpointing_use_reentrant".split()
    ppo = parse_config(PPOConfig, argv, "train_ppo_ray")
    sft = parse_config(SFTConfig, ["--adam.eps", "1e-6", "--model.gradient_checkpointing_reentrant"], "train_sft")
    assert _optimizer_kwargs(ppo, 1e-4, 4)["eps"] == setup.optimizer_kwargs(sft, 4)["eps"] == 1e-6
    assert ppo.model.build_kwargs()["reentrant_checkpointing"] and sft.model.build_kwargs()["reentrant_checkpointing"]


def test_grad_accum_dtype_and_universal_checkpoints_reach_the_deepspeed_engine():
    """--grad_accum_dtype (OpenRLHF's --ds.grad_accum_dtype) is the engine's gradient-accumulation dtype;
    --use_ds_universal_ckpt makes it load universal checkpoints."""
    engine = _engine(
        torch.bfloat16, zero_stage=2, param_dtype="bf16", grad_accum_dtype="fp32", use_ds_universal_ckpt=True
    )
    assert engine.get_data_types() == (torch.bfloat16, torch.float32)
    assert engine.load_universal_checkpoint()


def test_full_determinism_of_the_supervised_clis():
    """--full_determinism (OpenRLHF's --train.full_determinism_enable) in train_sft/rm/dpo: transformers'
    enable_full_determinism, after which a training forward and backward still run (no op lacks a deterministic
    kernel on this path) and repeat bit for bit."""
    from openppo.config.schema import parse_config
    from openppo.models.row_layout import RowLayout
    from openppo.trainers import setup
    from openppo.trainers.configs import SFTConfig

    cfg = parse_config(SFTConfig, "--train.full_determinism_enable --zero_stage 0".split(), "train_sft")
    assert not torch.are_deterministic_algorithms_enabled()
    try:
        setup.make_strategy(cfg)
        assert torch.are_deterministic_algorithms_enabled()
        runs = []
        for packed in (False, True, True):
            actor = Actor.from_pretrained(str(tiny_model_dir()), dtype=torch.float32).train()
            actor.layout = RowLayout(packed=packed)
            seqs = torch.arange(10, 34).reshape(2, 12)
            attn = torch.ones_like(seqs)
            attn[1, 8:] = 0
            actor(seqs, attn).log_probs.sum().backward()
            runs.append(actor.model.get_input_embeddings().weight.grad.clone())
        assert torch.equal(runs[1], runs[2])
    finally:
        torch.use_deterministic_algorithms(False)


def test_flash_attention_2_falls_back_to_sdpa_where_it_cannot_run(monkeypatch, caplog):
    """OpenRLHF's and Molt's recipes pass flash_attention_2; without a CUDA device, without the flash-attn package, or
    for an fp32 model, the model loads with sdpa and one line says so (the GPU case is mocked: torch.cuda.is_available
    is CUDA-only, and flash-attn a CUDA-only package)."""
    import importlib.util

    from openppo.models import hf

    hf._say_once.cache_clear()
    assert hf.attention_kernel("eager") == "eager"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level("WARNING"):
        assert hf.attention_kernel("flash_attention_2") == "sdpa"
        assert hf.attention_kernel("flash_attention_2") == "sdpa"
    assert [r.message for r in caplog.records] == [
        "--attn_implementation flash_attention_2 needs a CUDA device: sdpa instead (the same attention)"
    ]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    real = importlib.util.find_spec
    for installed, kernel in ((None, "sdpa"), (object(), "flash_attention_2")):
        monkeypatch.setattr(
            importlib.util, "find_spec", lambda n, *a, s=installed: s if n == "flash_attn" else real(n, *a)
        )
        assert hf.attention_kernel("flash_attention_2") == kernel
    # installed on a GPU, for a model that computes in half precision only: flash-attn's kernels refuse fp32 inputs
    # (transformers only warns at load)
    assert hf.attention_kernel("flash_attention_2", torch.bfloat16) == "flash_attention_2"
    assert hf.attention_kernel("flash_attention_2", torch.float16) == "flash_attention_2"
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert hf.attention_kernel("flash_attention_2", torch.float32) == "sdpa"
    assert [r.message for r in caplog.records] == [
        "--attn_implementation flash_attention_2 computes in fp16 or bf16 only, and this model computes in float32 "
        "(--param_dtype): sdpa instead (the same attention)"
    ]
    # a model built with it runs here
    monkeypatch.undo()
    actor = Actor.from_pretrained(str(tiny_model_dir()), dtype=torch.float32, attn_implementation="flash_attention_2")
    assert actor.model.config._attn_implementation != "flash_attention_2"
