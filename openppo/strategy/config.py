"""DeepSpeed strategy config and the DeepSpeed JSON it produces."""

from __future__ import annotations

from dataclasses import dataclass

from openppo.config.schema import opt
from openppo.errors import require

PARAM_DTYPES = ("auto", "bf16", "fp16", "fp32")

REDUCE_BUCKET_SIZE = 5e8  # elements per ZeRO-1/2 gradient reduction bucket (also read by the memory planner)


@dataclass
class DeepSpeedConfig:
    """DeepSpeed ZeRO, precision and distributed settings."""

    zero_stage: int = opt(
        2,
        "ZeRO stage: 0 = plain data parallel, 1 = shard optimizer states, 2 = + gradients, 3 = + parameters",
        choices=(0, 1, 2, 3),
    )
    param_dtype: str = opt(
        "auto",
        "training precision (bf16/fp16 keep fp32 master weights; fp16 needs a GPU); "
        "auto = bf16 where the device runs it fast (a GPU with bf16, a CPU with "
        "AVX512_BF16/AMX), else fp32; the choice is logged",
        choices=PARAM_DTYPES,
    )
    adam_offload: bool = opt(False, "keep optimizer states on CPU (ZeRO-Offload) to save device memory")
    grad_accum_dtype: str = opt(
        None,
        "dtype DeepSpeed accumulates gradients in across micro-batches; default: DeepSpeed's choice",
        choices=("fp32", "bf16", "fp16"),
    )
    use_ds_universal_ckpt: bool = opt(
        False,
        "load DeepSpeed universal checkpoints (converted with DeepSpeed's ds_to_universal), so a run resumes "
        "on another number of ranks",
    )
    overlap_comm: bool = opt(False, "overlap gradient reduction with backward (more memory, faster)")
    zpg: int = opt(1, "ZeRO++ hierarchical partition size (ZeRO-3 only); 1 = off")
    dist_timeout: int = opt(600, "seconds any collective may wait before the run fails instead of hanging")
    max_nonfinite_steps: int = opt(
        3,
        "optimizer steps in a row that may be skipped for a NaN/Inf loss or gradient "
        "(each logs a warning and leaves weights and optimizer state unchanged) before "
        "the run stops with an error; 0 = stop at the first",
    )


def validate_ds_settings(cfg: DeepSpeedConfig) -> None:
    """Checks that need no process group; raise UserError naming the flag."""
    require(cfg.zpg >= 1, f"--zpg must be >= 1 (1 = off), got {cfg.zpg}")
    require(cfg.dist_timeout > 0, f"--dist_timeout must be positive (seconds), got {cfg.dist_timeout}")
    require(
        cfg.max_nonfinite_steps >= 0,
        f"--max_nonfinite_steps must be >= 0 (0 = stop at the first NaN/Inf step), got {cfg.max_nonfinite_steps}",
    )


def ds_notices(cfg: DeepSpeedConfig, on_gpu: bool) -> list[str]:
    """One line for each DeepSpeed option that is accepted but has no effect with these settings or here."""
    notices = []
    if cfg.zpg > 1 and cfg.zero_stage != 3:
        notices.append(
            f"--zpg {cfg.zpg} has no effect with --zero_stage {cfg.zero_stage}: ZeRO++ hierarchical "
            f"partitioning splits ZeRO-3's parameter shards (use --zero_stage 3)"
        )
    if cfg.adam_offload and not on_gpu:
        notices.append(
            "--adam_offload saves no memory on CPU: the optimizer states already live in host memory "
            "(DeepSpeed's offload path still runs)"
        )
    return notices


def train_ds_config(
    cfg: DeepSpeedConfig,
    *,
    train_batch_size: int,
    micro_batch_size: int,
    world_size: int,
    max_norm: float,
    on_gpu: bool,
    tensor_parallel_size: int = 1,
) -> dict:
    """The DeepSpeed JSON for a trained model. Batch sizes must already be validated to divide.

    `train_batch_size` counts every rank as a replica, tensor-parallel ones included (DeepSpeed's arithmetic)."""
    zero: dict = {
        "stage": cfg.zero_stage,
        "overlap_comm": cfg.overlap_comm,
        "contiguous_gradients": True,
        "reduce_bucket_size": REDUCE_BUCKET_SIZE,
        # Lets HF export gather full ZeRO-3 weights on rank 0.
        "stage3_gather_16bit_weights_on_model_save": True,
    }
    if cfg.zero_stage == 3:
        zero["stage3_param_persistence_threshold"] = 1e4
        zero["stage3_prefetch_bucket_size"] = 5e7
        if cfg.zpg > 1:
            zero["zero_hpz_partition_size"] = cfg.zpg
    if cfg.adam_offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": on_gpu}
    extra = {"compile": {"deepcompile": True}} if getattr(cfg, "deepcompile", False) else {}
    if tensor_parallel_size > 1:
        # A replicated LM head gives every rank the full-vocabulary logits the RL losses need (a vocab-parallel
        # head would leave each rank a slice of the softmax).
        extra["tensor_parallel"] = {"autotp_size": tensor_parallel_size, "vocab_parallel_lm_head": False}
    if cfg.use_ds_universal_ckpt:
        extra["checkpoint"] = {"load_universal": True}
    if cfg.grad_accum_dtype is not None:
        extra["data_types"] = {"grad_accum_dtype": cfg.grad_accum_dtype}
    config = {
        **extra,
        "train_batch_size": train_batch_size,
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": train_batch_size // (micro_batch_size * world_size),
        "gradient_clipping": max_norm if max_norm > 0 else 0.0,
        "zero_optimization": zero,
        # check_grad_overflow (DeepSpeed's default, pinned): ZeRO skips a bf16 step with a NaN/Inf gradient, which
        # openppo.strategy.step_guard relies on
        "bf16": {"enabled": cfg.param_dtype == "bf16", "check_grad_overflow": True},
        "fp16": {"enabled": cfg.param_dtype == "fp16", "initial_scale_power": 16},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        # On CPU the client optimizer is torch's AdamW (no JIT build); DeepSpeed must not insist on its CPUAdam.
        "zero_force_ds_cpu_optimizer": on_gpu,
        "zero_allow_untested_optimizer": True,
    }
    return config


def eval_ds_config(
    cfg: DeepSpeedConfig, *, micro_batch_size: int, world_size: int, offload: bool, on_gpu: bool
) -> dict:
    """The DeepSpeed JSON for a frozen model (reference, reward): ZeRO-3 shards it only when asked to."""
    stage = cfg.zero_stage if cfg.zero_stage == 3 else 0
    zero: dict = {"stage": stage, "stage3_param_persistence_threshold": 1e4}
    if offload:
        zero["offload_param"] = {"device": "cpu", "pin_memory": on_gpu}
    return {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "train_batch_size": micro_batch_size * world_size,
        "zero_optimization": zero,
        "bf16": {"enabled": cfg.param_dtype == "bf16"},
        "fp16": {"enabled": cfg.param_dtype == "fp16"},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def state_offload_supported(zero_stage: int, on_gpu: bool) -> bool:
    """Whether DeepSpeed's `offload_states`/`reload_states` work for a trained engine.

    They need a ZeRO optimizer (stage >= 1); under ZeRO-3 also DeepSpeed's FusedAdam, which is the GPU optimizer
    here, while CPU runs use torch's AdamW (measured: ZeRO-3 asserts "supported only for DeepSpeed FusedAdam",
    ZeRO-1/2 work on CPU).
    """
    return zero_stage in (1, 2) or (zero_stage == 3 and on_gpu)
