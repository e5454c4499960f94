"""NaN/Inf steps are skipped without a trace, and a run of them stops with a clear error (--max_nonfinite_steps).

Real DeepSpeed (gloo; one rank in-process, two spawned ranks for the agreement test), through both training loops:
`fit_experience` (the RL update of actor and critic) and the supervised loop. A skipped step must leave the weights
bit-identical, and the next step must train exactly like an engine that never saw the bad batch (no NaN left in a
gradient buffer, no Adam step, no LR step).
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path

import pytest
import torch

from openppo.errors import UserError
from openppo.models.actor import Actor
from openppo.ppo.batching import Batching
from openppo.ppo.config import AlgoConfig
from openppo.ppo.fit import actor_loss, fit_experience
from openppo.strategy.config import DeepSpeedConfig, validate_ds_settings
from openppo.strategy.deepspeed_strategy import DeepSpeedStrategy
from openppo.trainers.loop import SupervisedTrainer
from tests.model_cache import tiny_model_dir
from tests.ppo.rank_helpers import train_engine
from tests.spawn import run_ranks

# ZeRO-0 fp32 is the one case where the guard checks gradients itself (torch's optimizer, unwrapped); the others
# use DeepSpeed's own overflow skip (ZeRO-0 bf16: its bf16 wrapper; ZeRO-1/2/3: the ZeRO optimizers).


def _strategy(stage: int, dtype: str, *, limit: int = 3, micro: int = 2, accum: int = 2) -> DeepSpeedStrategy:
    s = DeepSpeedStrategy(
        DeepSpeedConfig(zero_stage=stage, param_dtype=dtype, dist_timeout=120, max_nonfinite_steps=limit),
        train_batch_size=micro * accum,
        micro_batch_size=micro,
        max_norm=1.0,
        seed=0,
    )
    s.setup_distributed()
    return s


def _engine(strategy: DeepSpeedStrategy):
    model = Actor.from_pretrained(str(tiny_model_dir()), dtype=strategy.torch_dtype)
    return train_engine(strategy, model, lr=1e-3, steps=8)


def _weights(strategy: DeepSpeedStrategy, engine) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in strategy.gathered_state_dict(engine).items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _experience(nan_advantage: bool = False) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    seqs = torch.randint(10, 1000, (4, 9), generator=g)
    mask = torch.zeros(4, 8, dtype=torch.long)
    mask[:, 3:] = 1
    data = {
        "sequences": seqs,
        "attention_mask": torch.ones_like(seqs),
        "action_mask": mask,
        "advantages": torch.randn(4, 8, generator=g) * mask,
    }
    if nan_advantage:
        data["advantages"][1, 5] = float("nan")  # one response token of one row
    return data


class _NanGrad(torch.autograd.Function):
    """Identity forward, NaN backward: a finite loss whose gradient is not."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * float("nan")


def _loss_fn(engine, nan_grad: bool = False):
    # no old log-probs: one on-policy step (ratio 1), so the loss is -mean(A) and every batch moves the weights
    loss_fn = actor_loss(
        engine,
        AlgoConfig(advantage_estimator="reinforce", init_kl_coef=0.0),
        kl_coef=0.0,
        temperature=1.0,
        generate_max_len=8,
        is_correction=None,
        is_threshold=(0.5, 5.0),
    )
    if not nan_grad:
        return loss_fn

    def poisoned(batch, normalizers):
        loss, metrics = loss_fn(batch, normalizers)
        return _NanGrad.apply(loss), metrics

    return poisoned


def _fit(engine, strategy, data, loss_fn, guard, epochs: int = 1):
    """One optimizer step per epoch (4 rows, 2 micro-batches of 2)."""
    return fit_experience(
        engine,
        data,
        loss_fn,
        batching=Batching(rows=2),
        rows_per_step=4,
        epochs=epochs,
        world_size=1,
        seed=0,
        device=strategy.device,
        guard=guard,
    )


# Every setup once, both causes on the path openppo checks itself (fp32 ZeRO-0) and on each DeepSpeed wrapper kind.
SKIP_CASES = [
    (0, "fp32", "loss"),
    (0, "fp32", "gradient"),
    (2, "fp32", "gradient"),
    (0, "bf16", "loss"),
    (2, "bf16", "gradient"),
    (1, "fp32", "loss"),
    (3, "bf16", "gradient"),
]


@pytest.mark.parametrize("stage,dtype,cause", SKIP_CASES)
def test_nonfinite_step_is_skipped_without_a_trace(stage, dtype, cause, caplog):
    strategy = _strategy(stage, dtype)
    engine = _engine(strategy)
    guard = strategy.step_guard(engine, "actor", "train/actor_skipped_steps")
    before = _weights(strategy, engine)
    bad_data = _experience(nan_advantage=cause == "loss")
    with caplog.at_level(logging.WARNING, logger="openppo.strategy.step_guard"):
        bad = _fit(engine, strategy, bad_data, _loss_fn(engine, nan_grad=cause == "gradient"), guard)
    assert _same(_weights(strategy, engine), before)
    assert bad["train/actor_skipped_steps"] == 1.0 and guard.consecutive == 1
    assert "train/policy_loss" not in bad  # a skipped step's NaN loss stays out of the means
    # (ZeRO-1/2/3 log DeepSpeed's own "OVERFLOW! Skipping step" line too)
    warnings = [r.getMessage() for r in caplog.records if r.name == "openppo.strategy.step_guard"]
    assert warnings == [
        f"actor: skipped optimizer step 1: NaN/Inf {cause}; weights and optimizer state unchanged "
        f"(1 in a row, --max_nonfinite_steps 3)"
    ]

    good = _fit(engine, strategy, _experience(), _loss_fn(engine), guard)
    assert good["train/actor_skipped_steps"] == 0.0 and guard.consecutive == 0 and guard.skipped == 1
    assert math.isfinite(good["train/policy_loss"])
    after = _weights(strategy, engine)
    assert not _same(after, before)

    # An engine that only ever saw the good batch ends bit-identical: the skip left no state behind.
    fresh_engine = _engine(strategy)
    _fit(fresh_engine, strategy, _experience(), _loss_fn(fresh_engine), strategy.step_guard(fresh_engine, "actor"))
    assert _same(_weights(strategy, fresh_engine), after)


@pytest.mark.parametrize("stage", [0, 2])
def test_too_many_nonfinite_steps_in_a_row_stop_the_run(stage):
    strategy = _strategy(stage, "fp32", limit=2)
    engine = _engine(strategy)
    guard = strategy.step_guard(engine, "critic", "train/critic_skipped_steps")
    loss_fn = _loss_fn(engine)
    bad = _experience(nan_advantage=True)
    # bad, bad, good, bad, bad: an applied step resets the count, so 2 in a row never exceed the limit
    assert _fit(engine, strategy, bad, loss_fn, guard, epochs=2)["train/critic_skipped_steps"] == 2.0
    _fit(engine, strategy, _experience(), loss_fn, guard)
    assert _fit(engine, strategy, bad, loss_fn, guard, epochs=2)["train/critic_skipped_steps"] == 2.0
    before = _weights(strategy, engine)
    with pytest.raises(UserError) as err:
        _fit(engine, strategy, bad, loss_fn, guard)  # the third in a row
    message = str(err.value)
    assert message.startswith(
        "critic: 3 optimizer steps in a row (up to step 6) had a NaN/Inf loss and were "
        "skipped, more than --max_nonfinite_steps 2"
    )
    assert "lower the learning rate" in message and "--max_norm" in message and "\n" not in message
    assert _same(_weights(strategy, engine), before)  # the last one was skipped too


def test_limit_zero_stops_at_the_first_nonfinite_step():
    strategy = _strategy(0, "fp32", limit=0)
    engine = _engine(strategy)
    with pytest.raises(UserError, match="1 optimizer steps in a row .* NaN/Inf gradient"):
        _fit(engine, strategy, _experience(), _loss_fn(engine, nan_grad=True), strategy.step_guard(engine, "actor"))


def test_negative_limit_is_rejected():
    with pytest.raises(UserError, match="--max_nonfinite_steps must be >= 0"):
        validate_ds_settings(DeepSpeedConfig(max_nonfinite_steps=-1))


# ---------------------------------------------------------------------------------------------- two ranks
def _two_rank_worker(rank: int, out_dir: str, port: int) -> None:
    """Only rank 1 sees the NaN (its loss, then its gradient): both ranks must skip the same steps."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("openppo.strategy.step_guard").addHandler(handler)
    logging.getLogger("openppo.strategy.step_guard").setLevel(logging.WARNING)
    results: dict = {}
    for stage, dtype in TWO_RANK_SETUPS:
        strategy = DeepSpeedStrategy(
            DeepSpeedConfig(zero_stage=stage, param_dtype=dtype, dist_timeout=60),
            train_batch_size=8,
            micro_batch_size=2,
            max_norm=1.0,
            seed=0,
        )
        strategy.setup_distributed()
        engine = _engine(strategy)
        guard = strategy.step_guard(engine, "actor")

        def local_weights():  # ZeRO <= 2: every rank holds the whole model
            return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}

        def fit(data, nan_grad=False):
            return fit_experience(
                engine,
                data,
                _loss_fn(engine, nan_grad),
                batching=Batching(rows=2),
                rows_per_step=4,
                epochs=1,
                world_size=2,
                seed=0,
                device=strategy.device,
                guard=guard,
            )["train/skipped_steps"]

        before = local_weights()
        skipped = [fit(_experience(nan_advantage=rank == 1)), fit(_experience(), nan_grad=rank == 1)]
        unchanged = _same(local_weights(), before)
        skipped.append(fit(_experience()))
        results[f"{stage}-{dtype}"] = {
            "skipped": skipped,
            "unchanged": unchanged,
            "trained": not _same(local_weights(), before),
            "messages": list(messages),
        }
        messages.clear()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    torch.distributed.destroy_process_group()


TWO_RANK_SETUPS = [(0, "fp32"), (2, "bf16")]


def test_ranks_skip_together_when_one_rank_sees_nan(tmp_path):
    ranks = run_ranks(_two_rank_worker, 2, tmp_path, 300, "two-rank step guard")
    for rank, results in enumerate(ranks):
        for setup, r in results.items():
            assert r["skipped"] == [1.0, 1.0, 0.0], (rank, setup)
            assert r["unchanged"] and r["trained"], (rank, setup)
            expected = (
                []
                if rank
                else [
                    f"actor: skipped optimizer step {step}: NaN/Inf {cause}; weights and optimizer state unchanged "
                    f"({step} in a row, --max_nonfinite_steps 3)"
                    for step, cause in ((1, "loss"), (2, "gradient"))
                ]
            )
            assert r["messages"] == expected, (rank, setup)


# ---------------------------------------------------------------------------------------------- supervised loop
class _Rows(torch.utils.data.Dataset):
    def __init__(self, n: int):
        self.rows = torch.randint(10, 1000, (n, 8), generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def _collate(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.stack(rows)}


class _Tracker:
    def __init__(self):
        self.logged: list[tuple[int, dict]] = []

    def log(self, step, metrics, echo=True):
        self.logged.append((step, dict(metrics)))


class _NLLTrainer(SupervisedTrainer):
    """Next-token loss on every token; the loss of the optimizer steps in `bad_steps` (0-based) is NaN."""

    name = "sft"

    def __init__(self, bad_steps: set[int], **kwargs):
        super().__init__(**kwargs)
        self.bad_steps = bad_steps
        self.calls = 0

    def compute_loss(self, batch):
        step = self.calls // self.accum
        self.calls += 1
        ids = batch["input_ids"]
        loss = -self.engine(ids, torch.ones_like(ids)).log_probs.float().mean()
        if step in self.bad_steps:
            loss = loss * float("nan")
        return loss, {"train/loss": loss.item()}


def _trainer(tmp_path, stage: int, bad_steps: set[int], limit: int, steps: int = 3) -> _NLLTrainer:
    from transformers import AutoTokenizer

    from openppo.config.common import CheckpointConfig, LoggingConfig, OptimConfig

    strategy = _strategy(stage, "fp32", limit=limit)
    optim = OptimConfig(
        train_batch_size=4,
        micro_train_batch_size=2,
        max_epochs=1,
        learning_rate=1e-3,
        lr_scheduler="constant",
        lr_warmup_ratio=0.0,
        seed=0,
    )
    return _NLLTrainer(
        bad_steps,
        strategy=strategy,
        engine=_engine(strategy),
        tokenizer=AutoTokenizer.from_pretrained(tiny_model_dir()),
        train_dataset=_Rows(4 * steps),
        eval_dataset=None,
        collate_fn=_collate,
        optim=optim,
        ckpt=CheckpointConfig(save_path=str(tmp_path / "out")),
        logging_cfg=LoggingConfig(),
        tracker=_Tracker(),
    )


@pytest.mark.parametrize("stage", [0, 2])
def test_supervised_loop_skips_a_nonfinite_step(tmp_path, stage):
    trainer = _trainer(tmp_path, stage, bad_steps={1}, limit=3)
    trainer.fit()
    logged = dict(trainer.tracker.logged)
    assert [logged[s]["train/skipped_steps"] for s in (1, 2, 3)] == [0, 1, 0]
    assert "train/loss" not in logged[2]  # the skipped step's NaN is not averaged in
    assert all(math.isfinite(logged[s]["train/loss"]) for s in (1, 3))
    assert trainer.guard.skipped == 1 and trainer.guard.consecutive == 0


def test_supervised_loop_stops_after_too_many_nonfinite_steps(tmp_path):
    trainer = _trainer(tmp_path, 2, bad_steps={0, 1, 2}, limit=1)
    before = _weights(trainer.strategy, trainer.engine)
    with pytest.raises(UserError, match=r"^sft: 2 optimizer steps in a row \(up to step 2\) had a NaN/Inf loss"):
        trainer.fit()
    assert _same(_weights(trainer.strategy, trainer.engine), before)


class _Fp16Engine:
    """DeepSpeed's fp16 engine with dynamic loss scaling as the guard sees it. A stand-in: DeepSpeed has no fp16 on
    CPU (--param_dtype fp16 is refused there), so the GPU-only branch of the guard is reached through the five
    calls it makes of the engine; each step reports whether DeepSpeed applied it."""

    def __init__(self, applied: list[bool]):
        from deepspeed.runtime.base_optimizer import DeepSpeedOptimizer

        self.optimizer = DeepSpeedOptimizer()  # a wrapper DeepSpeed checks itself: the guard reads no gradient
        self.applied, self.global_steps, self.device, self.losses = list(applied), 0, torch.device("cpu"), []

    def fp16_enabled(self) -> bool:
        return True

    def dynamic_loss_scale(self) -> bool:
        return True

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        self.losses.append(float(loss))

    def is_gradient_accumulation_boundary(self) -> bool:
        return True

    def step(self) -> None:
        self.global_steps += 1

    def was_step_applied(self) -> bool:
        return self.applied[self.global_steps - 1]


def test_fp16_loss_scaling_skips_are_not_counted_as_divergence(caplog):
    """fp16's dynamic loss scale skips the steps whose scaled gradients overflow while it searches for a scale:
    normal, logged at info, never counted toward --max_nonfinite_steps. A NaN loss under fp16 still counts."""
    from openppo.strategy.step_guard import StepGuard

    engine = _Fp16Engine([False] * 5 + [True])
    guard = StepGuard(engine, model="actor", max_consecutive=2)
    with caplog.at_level(logging.INFO, logger="openppo.strategy.step_guard"):
        for _ in range(5):  # more overflows in a row than the limit allows
            guard.backward(torch.tensor(1.0))
            assert guard.step() is False
    assert guard.skipped == 5 and guard.consecutive == 0
    messages = [r.getMessage() for r in caplog.records if r.name == "openppo.strategy.step_guard"]
    assert messages == [
        f"actor: optimizer step {s} skipped by fp16 loss scaling (gradient overflow)" for s in range(1, 6)
    ]
    guard.backward(torch.tensor(1.0))
    assert guard.step() is True and guard.consecutive == 0

    nan = _Fp16Engine([False] * 3)
    guard = StepGuard(nan, model="actor", max_consecutive=2)
    for _ in range(2):
        guard.backward(torch.tensor(float("nan")))
        assert guard.step() is False
    assert guard.consecutive == 2 and math.isnan(nan.losses[0])
    guard.backward(torch.tensor(float("nan")))
    with pytest.raises(UserError, match="3 optimizer steps in a row .* NaN/Inf loss"):
        guard.step()
