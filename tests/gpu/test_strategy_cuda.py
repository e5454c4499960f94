"""The DeepSpeed strategy on CUDA: the paths the CPU suite cannot run (FusedAdam, DeepSpeedCPUAdam, ZeRO-3 state
offload). Each update is the trainer's own: `Actor` under `DeepSpeedStrategy`, the GRPO loss, `fit_experience`."""

from __future__ import annotations

import math

import pytest
import torch

from tests.gpu.conftest import requires_cuda

pytestmark = [pytest.mark.gpu, requires_cuda]

ROWS, MICRO, SEQ, PROMPT = 8, 4, 96, 48


def _rows(vocab: int, seed: int = 0, shared: bool = False) -> dict[str, torch.Tensor]:
    """GRPO-shaped rows of ragged length (right padding), random advantages on the response tokens; `shared`: each
    pair of rows has one prompt."""
    g = torch.Generator().manual_seed(seed)
    seqs = torch.randint(100, vocab - 100, (ROWS, SEQ), generator=g)
    if shared:
        seqs[1::2, :PROMPT] = seqs[0::2, :PROMPT]
    attn = torch.ones_like(seqs)
    for row in range(ROWS):
        attn[row, SEQ - 7 * row :] = 0
    mask = torch.zeros(ROWS, SEQ - 1)
    mask[:, PROMPT - 1 :] = 1
    mask *= attn[:, 1:]
    return {
        "sequences": seqs,
        "attention_mask": attn,
        "action_mask": mask,
        "advantages": torch.randn(ROWS, SEQ - 1, generator=g) * mask,
    }


def _train_engine(
    model_dir, *, zero_stage: int, adam_offload: bool = False, checkpointing: bool = False, muon: bool = False
):
    from openppo.config.common import MuonSettings
    from openppo.models.actor import Actor
    from openppo.strategy.config import DeepSpeedConfig
    from openppo.strategy.deepspeed_strategy import DeepSpeedStrategy
    from tests.ppo.rank_helpers import train_engine

    strategy = DeepSpeedStrategy(
        DeepSpeedConfig(zero_stage=zero_stage, param_dtype="bf16", adam_offload=adam_offload, dist_timeout=600),
        train_batch_size=ROWS,
        micro_batch_size=MICRO,
        max_norm=0.0 if muon else 1.0,  # (Muon runs clip nothing unless asked: docs/algorithms.md, "Optimizer")
        seed=0,
    )
    strategy.setup_distributed()
    with strategy.zero3_init():
        actor = Actor.from_pretrained(str(model_dir), dtype=torch.bfloat16, gradient_checkpointing=checkpointing)
    muon_settings = MuonSettings(lr=0.02, momentum=0.95, weight_decay=0.0) if muon else None
    engine = train_engine(strategy, actor, lr=1e-3, steps=4, muon=muon_settings)
    return strategy, engine


def _grpo_loss(engine):
    """The trainer's GRPO loss for the engine's actor (`actor_loss`)."""
    from openppo.ppo.config import AlgoConfig
    from openppo.ppo.fit import actor_loss

    return actor_loss(
        engine,
        AlgoConfig(advantage_estimator="group_norm", init_kl_coef=0.0),
        kl_coef=0.0,
        temperature=1.0,
        generate_max_len=SEQ - PROMPT,
        is_correction=None,
        is_threshold=(0.5, 5.0),
    )


def _update(strategy, engine, seed: int = 0) -> dict[str, float]:
    from openppo.models.row_layout import RowLayout
    from openppo.ppo.batching import Batching
    from openppo.ppo.fit import fit_experience

    loss_fn = _grpo_loss(engine)
    engine.module.layout = RowLayout(packed=True)
    return fit_experience(
        engine,
        _rows(engine.module.config.vocab_size, seed),
        loss_fn,
        batching=Batching(packed=True, rows=MICRO),
        rows_per_step=ROWS,
        epochs=1,
        world_size=1,
        seed=seed,
        device=strategy.device,
    )


def _master_weights(engine) -> dict[str, torch.Tensor]:
    """fp32 master copy of every trainable parameter, gathered (ZeRO-3) and on the CPU."""
    from deepspeed.utils import safe_get_full_fp32_param

    return {
        name: safe_get_full_fp32_param(p).detach().float().cpu().clone()
        for name, p in engine.module.named_parameters()
        if p.requires_grad
    }


def _assert_a_step_moves_every_parameter(strategy, engine) -> None:
    """One update: the loss is finite, no step is skipped, and every parameter's master copy moves."""
    before = _master_weights(engine)
    metrics = _update(strategy, engine)
    after = _master_weights(engine)
    assert math.isfinite(metrics["train/policy_loss"]) and metrics.get("train/actor_skipped_steps", 0) == 0
    frozen = [name for name in before if torch.equal(before[name], after[name])]
    assert not frozen, f"{len(frozen)} of {len(before)} parameters did not change: {frozen[:5]}"


@pytest.mark.parametrize("adam_offload", [False, True], ids=["fused_adam", "adam_offload"])
def test_zero3_bf16_update_changes_every_parameter(single_rank, gpu_model_dir, adam_offload):
    """ZeRO-3, bf16, gradient checkpointing, packed rows: the optimizer is DeepSpeed's GPU FusedAdam (or its
    DeepSpeedCPUAdam with --adam_offload), the loss is finite, and one step moves every parameter."""
    strategy, engine = _train_engine(gpu_model_dir, zero_stage=3, adam_offload=adam_offload, checkpointing=True)
    assert type(engine.basic_optimizer).__name__ == ("DeepSpeedCPUAdam" if adam_offload else "FusedAdam")
    _assert_a_step_moves_every_parameter(strategy, engine)


def test_zero3_bf16_muon_update_changes_every_parameter(single_rank, gpu_model_dir):
    """--optim muon on CUDA, ZeRO-3, bf16: DeepSpeed's Muon takes the matrices and its AdamW half is DeepSpeed's
    FusedAdam, JIT-built for the GPU (CPU runs take torch's AdamW: tests/strategy/test_muon.py checks the formulas);
    the loss is finite, and one step moves every parameter."""
    strategy, engine = _train_engine(gpu_model_dir, zero_stage=3, muon=True)
    assert type(engine.basic_optimizer).__name__ == "MuonWithAuxAdam"
    assert type(engine.basic_optimizer.aux_optimizer).__name__ == "FusedAdam"
    _assert_a_step_moves_every_parameter(strategy, engine)


def test_zero3_state_offload_frees_and_restores_gpu_memory(single_rank, gpu_model_dir):
    """--deepspeed_enable_sleep on ZeRO-3: offloading frees at least the fp32 master weights and Adam moments
    (12 bytes a parameter), reloading brings the same memory back, and training goes on."""
    from openppo.ppo.workers import _TrainedWorker

    strategy, engine = _train_engine(gpu_model_dir, zero_stage=3)
    _update(strategy, engine)
    role = _TrainedWorker()
    role.strategy, role.engine = strategy, engine
    params = sum(p.ds_numel for p in engine.module.parameters())
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    assert role.offload_states()
    torch.cuda.synchronize()
    offloaded = torch.cuda.memory_allocated()
    assert role.reload_states()
    torch.cuda.synchronize()
    reloaded = torch.cuda.memory_allocated()
    print(
        f"{params / 1e6:.1f} M params: {held / 2**20:.0f} MiB -> offloaded {offloaded / 2**20:.0f} MiB -> "
        f"reloaded {reloaded / 2**20:.0f} MiB"
    )
    assert held - offloaded >= 0.9 * 12 * params, (held, offloaded, params)
    assert abs(reloaded - held) <= 0.05 * held, (held, reloaded)
    assert math.isfinite(_update(strategy, engine, seed=1)["train/policy_loss"])


@pytest.mark.parametrize("layout", ["packed", "padded", "shared"])
def test_zero2_bf16_update_waits_on_the_gpu_only_at_optimizer_steps(single_rank, gpu_model_dir, layout):
    """Within a step the host never waits on the GPU (`openppo.utils.transfer`): none of the operations
    `torch.cuda.set_sync_debug_mode` reports runs in a micro-batch's forward, loss or backward, outside DeepSpeed
    (whose waits are listed). The CPU suite checks the same on marked tensors (tests/ppo/test_host_waits.py); this
    checks the CUDA calls it cannot: the pinned, non-blocking copies, that nothing else waits, and with shared
    prompts FlexAttention's block mask."""
    from pathlib import Path

    from bench.timeline import SyncSites
    from openppo.models.row_layout import RowLayout
    from openppo.ppo.batching import Batching
    from openppo.ppo.fit import fit_experience

    strategy, engine = _train_engine(gpu_model_dir, zero_stage=2)
    packed, shared = layout != "padded", layout == "shared"
    engine.module.layout = RowLayout(packed=packed, share_prompts=shared)
    loss_fn = _grpo_loss(engine)
    waits = SyncSites(Path(__file__).resolve().parents[2])
    backward = engine.backward

    def watched_loss(batch, normalizers):
        waits.__enter__()
        return loss_fn(batch, normalizers)

    def watched_backward(*args, **kwargs):
        try:
            return backward(*args, **kwargs)
        finally:
            waits.__exit__(None, None, None)

    engine.backward = watched_backward
    for seed in range(2):  # the first step warms the allocator and the kernels' caches
        waits.sites.clear()
        waits.waits.clear()
        rows = _rows(engine.module.config.vocab_size, seed, shared)
        rows["rollout_log_probs"] = -torch.rand(rows["action_mask"].shape) * rows["action_mask"]
        metrics = fit_experience(
            engine,
            rows,
            watched_loss,
            batching=Batching(packed=packed, rows=MICRO, share_prompts=shared),
            rows_per_step=ROWS,
            epochs=1,
            world_size=1,
            seed=seed,
            device=strategy.device,
        )
    ours = [site for site, stack in waits.waits if not any("deepspeed" in f.filename for f in stack)]
    print("host waits in a step's micro-batches (DeepSpeed's included):", dict(waits.sites))
    assert ours == [] and math.isfinite(metrics["train/policy_loss"])

    # a forward-only pass as the actor's log-prob passes run it (openppo.ppo.workers): no wait until its result
    from openppo.ppo.batching import ForwardChunks

    waits.sites.clear()
    waits.waits.clear()
    with torch.no_grad():
        chunks = ForwardChunks(engine, strategy, rows, Batching(packed=packed, rows=MICRO, share_prompts=shared))
        with waits:  # the copies to the device included
            for b in chunks:
                out = engine(b["sequences"], b.host["attention_mask"], score_mask=b.host["action_mask"])
                chunks.add(out.log_probs)
        assert chunks.result().shape == rows["action_mask"].shape
    assert dict(waits.sites) == {}


@pytest.mark.parametrize("zero_stage,offload", [(0, False), (3, False), (3, True)], ids=["zero0", "zero3", "offload"])
def test_a_frozen_model_under_deepspeed_gives_the_plain_models_log_probs(
    single_rank, gpu_model_dir, zero_stage, offload
):
    """The reference (and teacher, reward) ranks' engines on CUDA, built as `_FrozenWorker` builds them: ZeRO-3
    shards a frozen model, `--ref_reward_offload` keeps its parameters in pinned host memory and gathers them per
    layer. Its log-probs are those of the same weights run plainly on the GPU."""
    from openppo.models.actor import Actor
    from openppo.strategy.config import DeepSpeedConfig
    from openppo.strategy.deepspeed_strategy import DeepSpeedStrategy

    strategy = DeepSpeedStrategy(
        DeepSpeedConfig(zero_stage=zero_stage, param_dtype="bf16", dist_timeout=600),
        train_batch_size=MICRO,
        micro_batch_size=MICRO,
        max_norm=1.0,
        seed=0,
    )
    strategy.setup_distributed()
    plain = Actor.from_pretrained(str(gpu_model_dir), dtype=torch.bfloat16).cuda().eval()
    with strategy.zero3_init(for_training=False, offload=offload):
        frozen = Actor.from_pretrained(str(gpu_model_dir), dtype=torch.bfloat16)
    engine = strategy.prepare_eval(frozen, offload=offload)
    rows = _rows(plain.config.vocab_size)
    seqs, attn = rows["sequences"][:MICRO].cuda(), rows["attention_mask"][:MICRO].cuda()
    with torch.no_grad():
        got, want = engine(seqs, attn).log_probs, plain(seqs, attn).log_probs
    mask = attn[:, 1:].bool()
    assert got.shape == want.shape and got.isfinite().all()
    torch.testing.assert_close(got[mask].float(), want[mask].float(), atol=2e-2, rtol=0)
    assert not any(p.requires_grad for p in engine.module.parameters())
