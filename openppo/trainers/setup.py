"""Building blocks the supervised CLIs share: up-front validation, strategy, data, tracker, run info.

Validation runs before the process group starts and before anything is written, so a bad flag costs seconds
and leaves the save path untouched.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from openppo.config.common import validate_build, validate_outputs, validate_schedule
from openppo.config.schema import to_dict
from openppo.datasets import load_blended_dataset, require_columns
from openppo.errors import UserError, require
from openppo.models.hf import aux_loss_notice, kv_heads, resolve_model_path
from openppo.models.kernels import check_compile, liger_notice
from openppo.models.row_layout import RowLayout, ring_layout
from openppo.strategy.config import ds_notices, validate_ds_settings
from openppo.strategy.deepspeed_strategy import DeepSpeedStrategy, validate_batch_sizes, validate_precision
from openppo.trainers.configs import DataConfig
from openppo.utils.tracking import MetricsTracker, log_run_info, run_info

logger = logging.getLogger(__name__)


def launcher_world_size() -> int:
    """World size the launcher announced (torchrun / deepspeed set WORLD_SIZE); 1 for a plain run."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def validate_common(cfg: Any) -> None:
    """Checks every supervised CLI shares; raise UserError naming the flag."""
    resolve_model_path(cfg.model.pretrain, "--pretrain")
    validate_precision(cfg.ds.param_dtype, torch.cuda.is_available())
    _validate_replicas(cfg)
    validate_batch_sizes(
        cfg.optim.train_batch_size * cfg.ds.replicas, cfg.optim.micro_train_batch_size, launcher_world_size()
    )
    require(cfg.data.max_len > 0, f"--max_len must be positive, got {cfg.data.max_len}")
    require(cfg.optim.max_epochs > 0, f"--max_epochs must be positive, got {cfg.optim.max_epochs}")
    require(cfg.optim.learning_rate > 0, f"--learning_rate must be positive, got {cfg.optim.learning_rate}")
    require(cfg.logging.logging_steps > 0, f"--logging_steps must be positive, got {cfg.logging.logging_steps}")
    require(
        0.0 <= cfg.optim.lr_warmup_ratio < 1.0, f"--lr_warmup_ratio must be in [0, 1), got {cfg.optim.lr_warmup_ratio}"
    )
    validate_build(cfg.model)
    check_compile(
        cfg.model.torch_compile,
        use_liger_kernel=cfg.model.use_liger_kernel,
        zero_stage=cfg.ds.zero_stage,
        ring_attn_size=cfg.ds.ring_attn_size,
        tensor_parallel_size=cfg.ds.ds_tensor_parallel_size,
    )
    if (notice := aux_loss_notice(cfg.model.aux_loss_coef, cfg.model.pretrain)) is not None:
        logger.info("note: %s", notice)
    validate_schedule(min_lr_ratio=cfg.optim.min_lr_ratio, max_norm=cfg.optim.max_norm)
    validate_ds_settings(cfg.ds)
    for notice in ds_notices(cfg.ds, torch.cuda.is_available()):
        logger.info("note: %s", notice)
    if (notice := liger_notice(cfg.model.use_liger_kernel, torch.cuda.is_available())) is not None:
        logger.info("note: %s", notice)
    validate_outputs(cfg.ckpt, cfg.logging)


def _validate_replicas(cfg: Any) -> None:
    """--ring_attn_size and --ds_tensor_parallel_size: groups of consecutive ranks that train on the same rows."""
    ds, world = cfg.ds, launcher_world_size()
    ring, tp, stride = ds.ring_attn_size, ds.ds_tensor_parallel_size, ds.ring_head_stride
    require(ring >= 1, f"--ring_attn_size must be >= 1, got {ring}")
    require(tp >= 1, f"--ds_tensor_parallel_size must be >= 1, got {tp}")
    require(stride >= 0, f"--ring_head_stride must be >= 0 (0 = all KV heads at once), got {stride}")
    if ring > 1 and tp > 1:
        raise UserError("--ring_attn_size and --ds_tensor_parallel_size together are not supported: pick one")
    if ring > 1:
        require(cfg.data.packing_samples, "--ring_attn_size shards packed rows over ranks: add --packing_samples")
        require(world % ring == 0, f"--ring_attn_size {ring} must divide the ranks the launcher started ({world})")
        heads = kv_heads(cfg.model.pretrain)
        require(not stride or heads % stride == 0, f"--ring_head_stride {stride} must divide the KV heads ({heads})")
    if tp > 1:
        require(
            ds.zero_stage <= 2,
            f"--ds_tensor_parallel_size needs --zero_stage 0, 1 or 2 (DeepSpeed AutoTP), got {ds.zero_stage}",
        )
        require(cfg.model.lora_rank == 0, "--ds_tensor_parallel_size with --lora_rank is not supported: drop one")
        require(world % tp == 0, f"--ds_tensor_parallel_size {tp} must divide the ranks the launcher started ({world})")


def load_raw_data(data: DataConfig, keys: dict[str, str | None], seed: int):
    """(train, eval or None) datasets.Dataset objects, with the columns named by `keys` checked."""
    require(bool(data.dataset), "--dataset is required: pass a local .jsonl/.json/.parquet/.csv file or folder")
    train = load_blended_dataset(
        data.dataset,
        data.dataset_probs,
        flag="--dataset",
        probs_flag="--dataset_probs",
        seed=seed,
        max_samples=data.max_samples,
        split=data.dataset_split,
        split_flag="--dataset_split",
    )
    require_columns(train, keys, data.dataset)
    evaluation = None
    if data.eval_dataset:
        evaluation = load_blended_dataset(
            data.eval_dataset, None, flag="--eval_dataset", seed=seed, split=data.eval_split, split_flag="--eval_split"
        )
        require_columns(evaluation, keys, data.eval_dataset)
    return train, evaluation


def make_strategy(cfg: Any) -> DeepSpeedStrategy:
    # DeepSpeed counts every rank as a replica; the ranks of a ring or an AutoTP group share their rows.
    strategy = DeepSpeedStrategy(
        cfg.ds,
        train_batch_size=cfg.optim.train_batch_size * cfg.ds.replicas,
        micro_batch_size=cfg.optim.micro_train_batch_size,
        max_norm=cfg.optim.max_norm,
        seed=cfg.optim.seed,
        tensor_parallel_size=cfg.ds.ds_tensor_parallel_size,
        full_determinism=cfg.optim.full_determinism,
    )
    strategy.setup_distributed()
    return strategy


def set_layout(cfg: Any, *models) -> None:
    """Each model's row layout for the run: a ring over --ring_attn_size consecutive ranks (creating its groups is
    collective: every rank calls this), else packed (--packing_samples) or padded."""
    from openppo.models.actor import use_chunked_head

    ds = cfg.ds
    for model in models:
        if ds.ring_attn_size > 1:
            model.layout = ring_layout(model.model, ds.ring_attn_size, ds.ring_head_stride)
        else:
            model.layout = RowLayout(packed=cfg.data.packing_samples)
        use_chunked_head(model, cfg.model.lm_head_chunk_tokens)
    if ds.ring_attn_size > 1 and torch.distributed.get_rank() == 0:
        logger.info("ring attention: %d ranks share each packed row", ds.ring_attn_size)


def make_tracker(cfg: Any, strategy: DeepSpeedStrategy, cli: str) -> MetricsTracker:
    """Metrics sinks on rank 0, after logging the run info there."""
    config = to_dict(cfg)
    if strategy.is_rank0:
        log_run_info(run_info(config, cli), cfg.ckpt.save_path)
    return MetricsTracker.for_run(cfg, config, cli, enabled=strategy.is_rank0)


def train_kwargs(
    cfg: Any, strategy: DeepSpeedStrategy, engine, tokenizer, train_ds, eval_ds, collate_fn, tracker: MetricsTracker
) -> dict[str, Any]:
    """Keyword arguments of `SupervisedTrainer.__init__` drawn from a CLI config."""
    return dict(
        strategy=strategy,
        engine=engine,
        tokenizer=tokenizer,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        collate_fn=collate_fn,
        optim=cfg.optim,
        ckpt=cfg.ckpt,
        logging_cfg=cfg.logging,
        tracker=tracker,
        num_workers=cfg.data.dataloader_num_workers,
        aux_loss_coef=cfg.model.aux_loss_coef,
        replicas=cfg.ds.replicas,
        ring_size=cfg.ds.ring_attn_size,
    )


def optimizer_kwargs(cfg: Any, num_training_steps: int) -> dict[str, Any]:
    o = cfg.optim
    return dict(
        lr=o.learning_rate,
        betas=o.adam_betas,
        eps=o.adam_eps,
        weight_decay=o.l2,
        scheduler=o.lr_scheduler,
        warmup_ratio=o.lr_warmup_ratio,
        min_lr_ratio=o.min_lr_ratio,
        num_training_steps=num_training_steps,
        muon=o.muon_settings(o.l2),
    )
