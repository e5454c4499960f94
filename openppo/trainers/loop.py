"""The one training loop of the supervised stages (SFT, reward model, DPO).

A subclass supplies `compute_loss(batch) -> (loss, metrics)`; the loop owns everything else: the resumable data
order, gradient accumulation to `--train_batch_size` (DeepSpeed steps the optimizer at each boundary), metric
averaging over micro-batches and ranks, evaluation, checkpoints with rotation, resume and the final HF export.

Resume contract: a checkpoint at optimizer step k stores (epoch, steps done in that epoch); the restarted run
rebuilds the same shuffled order for that epoch (seeded by `--seed` + epoch) and skips the micro-batches already
consumed, so step k+1 sees exactly the samples an unbroken run would.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from tqdm import tqdm

from openppo.config.common import CheckpointConfig, LoggingConfig, OptimConfig
from openppo.errors import UserError
from openppo.strategy.checkpoint import hf_export_dir, max_bytes, rotate_hf
from openppo.strategy.deepspeed_strategy import DeepSpeedStrategy
from openppo.utils.hardware import trim_host_heap
from openppo.utils.tracking import MetricsTracker, set_aside_rows_after

logger = logging.getLogger(__name__)


class ResumableSampler(DistributedSampler):
    """A DistributedSampler whose epoch order can be entered part-way (after `skip` samples on this rank)."""

    def __init__(self, dataset: Dataset, *, num_replicas: int, rank: int, seed: int):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True)
        self.skip = 0

    def start(self, epoch: int, skip: int) -> None:
        self.set_epoch(epoch)
        self.skip = skip

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        return iter(indices[self.skip :])

    def __len__(self) -> int:
        return self.num_samples - self.skip


def move_to(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


class SupervisedTrainer:
    """Shared fit loop; subclasses define `name`, `compute_loss` and optionally `final_config`."""

    name = "supervised"

    def __init__(
        self,
        *,
        strategy: DeepSpeedStrategy,
        engine,
        tokenizer,
        train_dataset: Dataset,
        eval_dataset: Dataset | None,
        collate_fn: Callable,
        optim: OptimConfig,
        ckpt: CheckpointConfig,
        logging_cfg: LoggingConfig,
        tracker: MetricsTracker,
        num_workers: int = 0,
        aux_loss_coef: float = 0.0,
        replicas: int = 1,
        ring_size: int = 1,
    ):
        self.strategy = strategy
        self.engine = engine
        self.tokenizer = tokenizer
        self.train_dataset = train_dataset
        self.eval_dataset = eval_dataset
        self.collate_fn = collate_fn
        self.optim = optim
        self.ckpt = ckpt
        self.logging_cfg = logging_cfg
        self.tracker = tracker
        self.num_workers = num_workers  # --dataloader_num_workers: processes that collate batches
        self.aux_loss_coef = aux_loss_coef  # --aux_loss_coef: the MoE router's load-balancing loss, 0 = off
        # consecutive ranks holding the same rows (a ring, an AutoTP group) read one shard of the data
        self.replicas, self.ring_size = replicas, ring_size
        self.data_rank, self.data_ranks = strategy.rank // replicas, strategy.world_size // replicas
        self.guard = strategy.step_guard(engine, self.name)  # skips NaN/Inf steps (--max_nonfinite_steps)
        self.ckpt_dir = ckpt.checkpoint_dir()
        self.micro = optim.micro_train_batch_size
        self.accum = strategy.grad_accum_steps
        self.sampler = ResumableSampler(
            train_dataset, num_replicas=self.data_ranks, rank=self.data_rank, seed=optim.seed
        )
        self.steps_per_epoch = self.sampler.num_samples // (self.micro * self.accum)
        if self.steps_per_epoch == 0:
            raise UserError(
                f"--train_batch_size {optim.train_batch_size} is larger than the training set "
                f"({len(train_dataset)} samples); lower --train_batch_size or add data"
            )
        total = self.steps_per_epoch * optim.max_epochs
        self.total_steps = min(total, optim.max_steps) if optim.max_steps > 0 else total

    # ------------------------------------------------------------------------------------------------ subclass API
    def shard(self, dataset: Dataset) -> DistributedSampler:
        """This rank's share of `dataset` in order (eval, statistics): the same rows for a ring or AutoTP group."""
        return DistributedSampler(dataset, num_replicas=self.data_ranks, rank=self.data_rank, shuffle=False)

    def add_aux_loss(
        self, loss: torch.Tensor, metrics: dict[str, float], aux_loss: torch.Tensor | None
    ) -> torch.Tensor:
        """`loss` + --aux_loss_coef x the router's load-balancing loss of the same forward (when it returned one)."""
        if aux_loss is None:
            return loss
        metrics["train/aux_loss"] = aux_loss.item()
        return loss + self.aux_loss_coef * aux_loss

    def compute_loss(self, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        raise NotImplementedError

    def final_config(self) -> dict[str, Any]:
        """Extra config entries written into the exported HF folder."""
        return {}

    # ------------------------------------------------------------------------------------------------ loop
    @staticmethod
    def num_training_steps(dataset_len: int, optim: OptimConfig) -> int:
        """Optimizer steps the scheduler must span (needed before the engine exists)."""
        steps = (dataset_len // optim.train_batch_size) * optim.max_epochs
        return min(steps, optim.max_steps) if optim.max_steps > 0 else steps

    def _loader(self, epoch: int, skip_steps: int) -> DataLoader:
        self.sampler.start(epoch, skip_steps * self.micro * self.accum)
        return self.data_loader(self.train_dataset, self.sampler, drop_last=True)

    def data_loader(self, dataset: Dataset, sampler, drop_last: bool = False) -> DataLoader:
        """Micro-batches of `dataset` in `sampler`'s order, collated in --dataloader_num_workers processes."""
        return DataLoader(
            dataset,
            batch_size=self.micro,
            sampler=sampler,
            collate_fn=self.collate_fn,
            drop_last=drop_last,
            num_workers=self.num_workers,
        )

    def _resume(self) -> tuple[int, int, int]:
        """(global_step, epoch, steps done in that epoch) from the latest checkpoint, or zeros."""
        if not self.ckpt.load_checkpoint:
            return 0, 0, 0
        state = self.strategy.load_committed(self.engine, self.ckpt_dir)
        if state is None:
            logger.info("--load_checkpoint: no checkpoint in %s yet; starting fresh", self.ckpt_dir)
            return 0, 0, 0
        step = int(state["global_step"])
        logger.info("resumed from %s at step %d", self.ckpt_dir, step)
        if self.strategy.is_rank0:
            set_aside_rows_after(Path(self.ckpt.save_path) / "metrics.jsonl", step)
        return step, step // self.steps_per_epoch, step % self.steps_per_epoch

    def fit(self) -> dict[str, float]:
        global_step, start_epoch, skip = self._resume()
        saved_step = global_step if self.ckpt.load_checkpoint else None  # a resumed step is on disk already
        progress = tqdm(
            total=self.total_steps,
            initial=global_step,
            desc=f"{self.name} train",
            disable=not self.strategy.is_rank0,
            dynamic_ncols=True,
        )
        sums: dict[str, float] = defaultdict(float)
        step_sums: dict[str, float] = defaultdict(float)  # this optimizer step's, added to sums once it is applied
        count = step_count = skipped = 0
        last: dict[str, float] = {}
        self.engine.train()
        for epoch in range(start_epoch, self.optim.max_epochs):
            if global_step >= self.total_steps:
                break
            done_in_epoch = skip if epoch == start_epoch else 0
            for micro_step, batch in enumerate(self._loader(epoch, done_in_epoch)):
                loss, metrics = self.compute_loss(move_to(batch, self.strategy.device))
                # A ring rank's backward reaches its chunk's share of the row; DeepSpeed averages over every rank,
                # ring peers included, so the ring's shares are scaled back to one row's gradient.
                self.guard.backward(loss * self.ring_size)
                applied = self.guard.step()
                for key, value in metrics.items():
                    step_sums[key] += float(value)
                step_count += 1
                if (micro_step + 1) % self.accum:
                    continue
                if applied:  # a skipped step's (NaN) metrics would poison the means
                    for key, value in step_sums.items():
                        sums[key] += value
                    count += step_count
                else:
                    skipped += 1
                step_sums.clear()
                step_count = 0
                global_step += 1
                progress.update(1)
                trim_host_heap()  # at most once a minute: hands back what a CPU rank's heap keeps between steps
                if global_step % self.logging_cfg.logging_steps == 0 or global_step == self.total_steps:
                    last = self.strategy.all_reduce_mean({k: v / max(count, 1) for k, v in sums.items()})
                    last[self.guard.metric] = skipped  # the same on every rank: they skip together
                    last["train/lr"] = self.engine.get_lr()[0]
                    last["train/epoch"] = (
                        epoch + (done_in_epoch + (micro_step + 1) // self.accum) / self.steps_per_epoch
                    )
                    progress.set_postfix({k.split("/")[-1]: f"{v:.4g}" for k, v in last.items() if k.endswith("loss")})
                    self.tracker.log(global_step, last, echo=False)
                    sums.clear()
                    count = skipped = 0
                epoch_end = done_in_epoch + (micro_step + 1) // self.accum == self.steps_per_epoch
                if self._due(global_step, self.logging_cfg.eval_steps, epoch_end):
                    self.tracker.log(global_step, self.evaluate())
                if self._due(global_step, self.ckpt.save_steps, False):
                    self.save_checkpoint(global_step, epoch)
                    saved_step = global_step
                if global_step >= self.total_steps or epoch_end:
                    break
        progress.close()
        if (self.ckpt.save_steps > 0 or self.ckpt.load_checkpoint) and saved_step != global_step:
            self.save_checkpoint(global_step, epoch=global_step // self.steps_per_epoch)
        if self.ckpt.disable_final_save:
            if self.strategy.is_rank0:
                logger.info("--disable_final_save: the trained model is not exported to %s", self.ckpt.save_path)
        else:
            self.strategy.save_hf(self.engine, self.tokenizer, self.ckpt.save_path, self.final_config())
            if self.strategy.is_rank0:
                logger.info("saved the trained model to %s", self.ckpt.save_path)
        return last

    def _due(self, step: int, every: int, epoch_end: bool) -> bool:
        if every > 0:
            return step % every == 0
        return epoch_end and every == -1 and self.eval_dataset is not None

    # ------------------------------------------------------------------------------------------------ eval / ckpt
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Mean of `compute_loss` metrics over the eval set (each rank takes its share), prefixed `eval/`."""
        if self.eval_dataset is None:
            return {}
        self.engine.eval()
        loader = self.data_loader(self.eval_dataset, self.shard(self.eval_dataset))
        sums: dict[str, float] = defaultdict(float)
        batches = 0
        for batch in tqdm(loader, desc=f"{self.name} eval", disable=not self.strategy.is_rank0, leave=False):
            _, metrics = self.compute_loss(move_to(batch, self.strategy.device))
            for key, value in metrics.items():
                sums[key] += float(value)
            batches += 1
        self.engine.train()
        means = self.strategy.all_reduce_mean({k: v / max(1, batches) for k, v in sums.items()})
        return {"eval/" + k.split("/", 1)[-1]: v for k, v in means.items() if math.isfinite(v)}

    def save_checkpoint(self, step: int, epoch: int) -> None:
        if self.ckpt.disable_ds_ckpt:
            return
        state = {"global_step": step, "epoch": epoch, "trainer": self.name}
        self.strategy.save_committed(
            self.engine, self.ckpt_dir, step, state, self.ckpt.resumable_keep(), max_bytes(self.ckpt)
        )
        if self.ckpt.save_hf_ckpt:
            self.strategy.save_hf(self.engine, self.tokenizer, hf_export_dir(self.ckpt_dir, step), self.final_config())
            if self.strategy.is_rank0:
                rotate_hf(self.ckpt_dir, self.ckpt.max_ckpt_num)
