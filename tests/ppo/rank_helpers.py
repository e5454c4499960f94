"""Pieces the multi-rank training tests share: joining the gloo group, ragged RL rows, reading an engine's full
weights and the gradient it is about to apply."""

from __future__ import annotations

import os
from collections.abc import Callable

import torch


def join_gloo_group(rank: int, port: int, world: int) -> None:
    """The launcher environment of one spawned CPU rank, with one thread (the ranks share the cores)."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)


def ragged_rows(
    lengths: list[int], vocab: int, gen: torch.Generator, *, first_action: int = 1, empty_rows: tuple[int, ...] = ()
) -> dict[str, torch.Tensor]:
    """Right-padded rows of the given lengths (random tokens), the action mask from `first_action` to the row's
    second-to-last position (none for `empty_rows`), and random advantages, returns and a small log-prob noise."""
    width = max(lengths)
    seqs = torch.randint(10, vocab, (len(lengths), width), generator=gen)
    attn = torch.zeros_like(seqs)
    mask = torch.zeros(len(lengths), width - 1, dtype=torch.long)
    for row, n in enumerate(lengths):
        attn[row, :n] = 1
        mask[row, first_action : n - 1] = int(row not in empty_rows)
    seqs[attn == 0] = 0
    return {
        "sequences": seqs,
        "attention_mask": attn,
        "action_mask": mask,
        "advantages": torch.randn(mask.shape, generator=gen) * mask,
        "returns": torch.randn(mask.shape, generator=gen) * mask,
        "noise": 0.05 * torch.randn(mask.shape, generator=gen),
    }


def grouped_rows(groups: list[tuple[int, list[int]]], seed: int = 1) -> dict[str, torch.Tensor]:
    """Right-padded rows of GRPO-like groups, (prompt tokens, response lengths) each: the rows of a group start with
    the same random prompt; the action mask scores each response."""
    gen = torch.Generator().manual_seed(seed)
    rows, spans = [], []
    for p, responses in groups:
        prompt = torch.randint(10, 900, (p,), generator=gen)
        for n in responses:
            rows.append(torch.cat([prompt, torch.randint(10, 900, (n,), generator=gen)]))
            spans.append((p, n))
    width = max(r.numel() for r in rows)
    data = {
        "sequences": torch.zeros(len(rows), width, dtype=torch.long),
        "attention_mask": torch.zeros(len(rows), width, dtype=torch.long),
        "action_mask": torch.zeros(len(rows), width - 1),
    }
    for i, (row, (p, n)) in enumerate(zip(rows, spans)):
        data["sequences"][i, : row.numel()] = row
        data["attention_mask"][i, : row.numel()] = 1
        data["action_mask"][i, p - 1 : p - 1 + n] = 1
    return data


def full_weights(strategy, engine) -> dict[str, torch.Tensor]:
    """Every parameter of a DeepSpeed engine, whole (gathered under ZeRO-3; collective there)."""
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=strategy.cfg.zero_stage == 3):
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def full_grads(engine) -> dict[str, torch.Tensor]:
    """Every parameter's reduced fp32 gradient, whole, under any ZeRO stage (collective under ZeRO-3)."""
    from deepspeed.utils import safe_get_full_grad

    return {n: safe_get_full_grad(p).detach().clone() for n, p in engine.module.named_parameters()}


def local_grads(engine) -> dict[str, torch.Tensor]:
    """The `.grad` of every parameter as this rank holds it (ZeRO-0, AutoTP slices)."""
    return {n: p.grad.detach().clone() for n, p in engine.module.named_parameters()}


class GradAtBoundary:
    """The engine, recording the accumulated gradient (`read(engine)`) each time an optimizer step is about to be
    taken, before the optimizer consumes it."""

    def __init__(self, engine, read: Callable = local_grads):
        self.engine, self.read, self.grads = engine, read, []

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def __call__(self, *args, **kwargs):
        return self.engine(*args, **kwargs)

    def step(self):
        if self.engine.is_gradient_accumulation_boundary():
            self.grads.append(self.read(self.engine))
        self.engine.step()


def fp32_strategy(zero_stage: int, *, max_norm: float = 1.0, train_batch_size: int = 8):
    """A set-up fp32 DeepSpeed strategy of the spawned group: 8 rows a step by default, micro-batches of 2."""
    from openppo.strategy.config import DeepSpeedConfig
    from openppo.strategy.deepspeed_strategy import DeepSpeedStrategy

    strategy = DeepSpeedStrategy(
        DeepSpeedConfig(zero_stage=zero_stage, param_dtype="fp32", dist_timeout=120),
        train_batch_size=train_batch_size,
        micro_batch_size=2,
        max_norm=max_norm,
        seed=0,
    )
    strategy.setup_distributed()
    return strategy


def load_model(role: str, path: str, strategy=None, **lora):
    """The fp32 model of a trained role: `Actor` ("actor", "lora": with `lora` options) or the critic's
    `ScalarModel` ("critic"), loaded under ZeRO-3's partitioning context when `strategy` is given."""
    import contextlib

    from openppo.models.actor import Actor
    from openppo.models.scalar import ScalarModel

    with strategy.zero3_init() if strategy is not None else contextlib.nullcontext():
        if role == "critic":
            return ScalarModel.from_pretrained(path, dtype=torch.float32, flag="--critic_pretrain")
        return Actor.from_pretrained(path, dtype=torch.float32, **lora)


# -- the step loss written out from the formulas (docs/algorithms.md), the independent side of gradient parity tests


def ppo_per_token(log_probs: torch.Tensor, old: torch.Tensor, adv: torch.Tensor, eps: float) -> torch.Tensor:
    ratio = (log_probs - old).exp()
    return -torch.minimum(ratio * adv, ratio.clamp(1 - eps, 1 + eps) * adv)


def value_per_token(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float) -> torch.Tensor:
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    return 0.5 * torch.maximum((values - returns).square(), (clipped - returns).square())


def reduce_global(per_token: torch.Tensor, mask: torch.Tensor, mode: str, norm_len: int) -> torch.Tensor:
    """The step loss over every row of the step (S_i = a response's summed loss, n_i its kept tokens, N = all kept
    tokens, M = responses with a kept token)."""
    m = mask.to(per_token.dtype)
    sums, counts = (per_token * m).sum(-1), m.sum(-1)
    kept = counts > 0
    if mode == "token-mean":
        return sums.sum() / m.sum()
    if mode == "seq-mean-token-mean":
        return (sums[kept] / counts[kept]).sum() / kept.sum()
    if mode == "seq-mean-token-sum":
        return sums.sum() / kept.sum()
    return sums.sum() / (kept.sum() * norm_len)  # Dr. GRPO


def train_engine(strategy, model, *, lr: float, steps: int, min_lr_ratio: float = 0.1, eps: float = 1e-8, muon=None):
    """`strategy.prepare_train` with the tests' fixed schedule: AdamW betas (0.9, 0.95), no weight decay, a constant
    LR over `steps` optimizer steps; DeepSpeed's Muon for the matrices with `muon` (a `MuonSettings`)."""
    return strategy.prepare_train(
        model,
        lr=lr,
        betas=(0.9, 0.95),
        weight_decay=0.0,
        scheduler="constant",
        warmup_ratio=0.0,
        min_lr_ratio=min_lr_ratio,
        num_training_steps=steps,
        eps=eps,
        muon=muon,
    )
