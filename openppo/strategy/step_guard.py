"""Skip optimizer steps whose loss or gradient is NaN/Inf, and stop a run that keeps producing them.

One NaN in a loss or a gradient turns every weight it reaches into NaN at the next optimizer update, and the run would
go on training a broken model. `StepGuard` wraps a DeepSpeed engine's `backward` and `step` (both training loops call
it, the PPO one in openppo.ppo.fit and the supervised one in openppo.trainers.loop):

- A micro-batch loss that is not finite is backpropagated times NaN, so every gradient it reaches is NaN, also when
  the bad value carries no gradient (a NaN behind a mask: 0 * NaN is NaN). A finite loss is multiplied by exactly 1.
  No host sync: the check stays on the device.
- At the accumulation boundary DeepSpeed's own optimizer wrappers (deepspeed 0.19) already skip a step whose gradient
  is not finite: ZeRO-1/2 (an invalid global norm; bf16 also tests every gradient), ZeRO-3 (an invalid norm) and the
  bf16 wrapper of ZeRO-0 (tests every gradient). Each decides on an all-reduced flag or norm, so all ranks skip the
  same step; each drops the gradients and its accumulation buffers and leaves the weights, the optimizer state and the
  LR schedule as they were; the engine counts the skip (`skipped_steps`) and `was_step_applied()` turns False.
- ZeRO-0 in fp32 hands torch's optimizer to DeepSpeed unwrapped, with no such check. There the guard tests the reduced
  gradients itself (one all-reduced flag per step: tensor-parallel ranks hold different slices) and, for a bad step,
  lends the optimizer for that one `engine.step()` what DeepSpeed's wrappers show after a skip: a `step` that changes
  nothing and `overflow = True`. The engine then drops the gradients, leaves the LR alone and counts the skip exactly
  as above. (Dropping the gradients beforehand instead breaks DeepSpeed's fp32 clipping, which needs one.)

Each skipped step logs one warning (rank 0) naming the step, the model and the cause; more than `max_consecutive`
skipped steps in a row raise a UserError. An applied step resets the count. The fast path adds no collective except
that one flag under ZeRO-0 fp32.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch

from openppo.errors import UserError

logger = logging.getLogger(__name__)


def _world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _any_rank(flag: torch.Tensor) -> bool:
    """Whether `flag` (a bool tensor) is true on any rank: one 1-element all-reduce."""
    t = flag.reshape(1).to(torch.int32)
    if _world()[1] > 1:
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return bool(t.item())


def _no_update(*args, **kwargs) -> None:
    """The optimizer step of a skipped step."""


@contextlib.contextmanager
def _skip_protocol(optimizer) -> Iterator[None]:
    """Give a torch optimizer, for one engine step, what DeepSpeed's wrappers show after a skipped step."""
    own_step = vars(optimizer).get("step")  # the LR scheduler wraps `step` on the instance: keep that wrapper
    optimizer.overflow, optimizer.step = True, _no_update
    try:
        yield
    finally:
        del optimizer.overflow
        if own_step is None:
            del optimizer.step
        else:
            optimizer.step = own_step


class StepGuard:
    """`backward` and `step` of one DeepSpeed engine that skip optimizer steps with a NaN/Inf loss or gradient.

    `model` names the engine in messages (actor, critic, sft...); `metric` is the key under which the training loop
    reports the number of skipped steps. `max_consecutive` is --max_nonfinite_steps: the most skipped steps in a row
    before the run stops (0 = stop at the first).
    """

    def __init__(self, engine, *, model: str, max_consecutive: int, metric: str = "train/skipped_steps"):
        from deepspeed.runtime.base_optimizer import DeepSpeedOptimizer

        self.engine = engine
        self.model = model
        self.max_consecutive = max_consecutive
        self.metric = metric
        self.skipped = 0  # skipped steps over the guard's life
        self.consecutive = 0  # skipped steps since the last applied one
        self._bad_loss: torch.Tensor | None = None  # a non-finite micro-batch loss in this step, on this rank
        # torch's optimizer, unwrapped (ZeRO-0 fp32): DeepSpeed does not look at its gradients
        self._unchecked = not isinstance(engine.optimizer, DeepSpeedOptimizer)
        # fp16 dynamic loss scaling skips overflowing steps while it searches for a scale: normal, not divergence
        self._loss_scaling = engine.fp16_enabled() and engine.dynamic_loss_scale()

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """`engine.backward(loss, **kwargs)`, with a non-finite loss turned into NaN gradients (see module doc)."""
        finite = torch.isfinite(loss.detach())
        bad = ~finite.all()
        self._bad_loss = bad if self._bad_loss is None else self._bad_loss | bad
        poison = torch.ones_like(loss).masked_fill(~finite, float("nan"))
        self.engine.backward(loss * poison, **kwargs)

    def step(self) -> bool:
        """`engine.step()`; True when it applied an optimizer update (False between accumulation boundaries and when
        the step was skipped). Raises UserError after more than `max_consecutive` skipped steps in a row."""
        if not self.engine.is_gradient_accumulation_boundary():
            self.engine.step()
            return False
        if self._unchecked and self._nonfinite_grads():
            with _skip_protocol(self.engine.optimizer):
                self.engine.step()
        else:
            self.engine.step()
        applied = self.engine.was_step_applied()
        bad_loss, self._bad_loss = self._bad_loss, None
        if applied:
            self.consecutive = 0
            return True
        self._skipped(bad_loss)
        return False

    def _nonfinite_grads(self) -> bool:
        """ZeRO-0 fp32: whether the reduced gradient is not finite on any rank."""
        grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
        if grads:
            bad = ~torch.isfinite(torch.nn.utils.get_total_norm(grads))
        else:
            bad = torch.zeros((), dtype=torch.bool, device=self.engine.device)
        return _any_rank(bad)

    def _skipped(self, bad_loss: torch.Tensor | None) -> None:
        # Every rank knows the step was skipped, so all of them join this collective (it runs only on skipped steps).
        if bad_loss is None:
            bad_loss = torch.zeros((), dtype=torch.bool, device=self.engine.device)
        cause = "loss" if _any_rank(bad_loss) else "gradient"
        self.skipped += 1
        step = self.engine.global_steps  # counts skipped steps too; this one included
        rank0 = _world()[0] == 0
        if cause == "gradient" and self._loss_scaling:
            if rank0:
                logger.info("%s: optimizer step %d skipped by fp16 loss scaling (gradient overflow)", self.model, step)
            return
        self.consecutive += 1
        if self.consecutive > self.max_consecutive:
            raise UserError(
                f"{self.model}: {self.consecutive} optimizer steps in a row (up to step {step}) had a NaN/Inf {cause} "
                f"and were skipped, more than --max_nonfinite_steps {self.max_consecutive}: training has diverged or "
                f"the inputs hold NaN/Inf; lower the learning rate, check the data and rewards for NaN or extreme "
                f"values, keep gradient clipping on (--max_norm > 0), try --param_dtype fp32, or raise "
                f"--max_nonfinite_steps"
            )
        if rank0:
            logger.warning(
                "%s: skipped optimizer step %d: NaN/Inf %s; weights and optimizer state unchanged "
                "(%d in a row, --max_nonfinite_steps %d)",
                self.model,
                step,
                cause,
                self.consecutive,
                self.max_consecutive,
            )
