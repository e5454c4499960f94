"""Config components shared by the training CLIs: model, optimiser, checkpointing, logging, and their checks.

Field names are the flat OpenRLHF flag names; each help line is what `--help` prints.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from openppo.config.schema import opt
from openppo.errors import UserError, require
from openppo.utils.paths import check_output_dir

LR_SCHEDULERS = ("cosine_with_min_lr", "cosine", "linear", "constant", "constant_with_warmup")


def value_head_prefix_opt():
    """OpenRLHF's --value_head_prefix: the scalar head's name. openppo's scalar models are transformers'
    *ForSequenceClassification, whose head is `score` (OpenRLHF's default too); that is the one name it takes."""
    return opt("score", "name of the scalar head's weights in the model folder (transformers' own)", choices=("score",))


@dataclass
class ModelBuildConfig:
    """How a trained model is built: attention kernel, activation checkpointing, LoRA."""

    attn_implementation: str = opt(
        "sdpa",
        "attention kernel passed to transformers",
        choices=("sdpa", "eager", "flash_attention_2", "flex_attention"),
    )
    gradient_checkpointing: bool = opt(False, "recompute activations in backward to save memory")
    gradient_checkpointing_use_reentrant: bool = opt(
        False, "reentrant activation checkpointing (torch's older variant); default: non-reentrant"
    )
    lora_rank: int = opt(0, "LoRA rank; 0 trains all weights")
    lora_alpha: int = opt(16, "LoRA alpha (scaling = alpha / rank)")
    lora_dropout: float = opt(0.0, "LoRA dropout")
    target_modules: list[str] = opt(None, "module names LoRA adapts; default: all linear layers", metavar="NAME")
    aux_loss_coef: float = opt(
        0.0,
        "weight of a mixture-of-experts model's router load-balancing loss in the trained model's loss (PPO: the "
        "actor's); 0 = off",
    )
    lm_head_chunk_tokens: int = opt(
        0,
        "score tokens through the LM head N positions at a time, from the decoder's hidden states, never making the "
        "whole tokens x vocabulary logits (less memory; the head runs again in backward); 0 = the model's own logits",
        metavar="N",
    )
    use_liger_kernel: bool = opt(
        False,
        "GPU: Liger's fused Triton kernels for RMSNorm, RoPE and the SwiGLU MLP in every model the run builds "
        "(needs the liger-kernel package; not with --torch_compile); no effect on CPU",
    )
    freeze_moe_router: bool = opt(
        False,
        "a mixture-of-experts model's router weights stay as loaded: routing is held fixed in training, and the "
        "trainer and the engines route alike (no effect on a dense model, said in one line)",
    )
    torch_compile: bool = opt(
        False,
        "torch.compile each decoder layer of every model the run trains or scores (one compiled graph reused by "
        "all layers; vLLM compiles its own unless --enforce_eager); the first step pays the compile; not with "
        "--use_liger_kernel",
    )

    def build_kwargs(self) -> dict:
        """Keyword arguments of `Actor.from_pretrained` / `ScalarModel.from_pretrained`."""
        return dict(
            attn_implementation=self.attn_implementation,
            lora_rank=self.lora_rank,
            lora_alpha=self.lora_alpha,
            lora_dropout=self.lora_dropout,
            target_modules=self.target_modules,
            gradient_checkpointing=self.gradient_checkpointing,
            reentrant_checkpointing=self.gradient_checkpointing_use_reentrant,
            freeze_moe_router=self.freeze_moe_router,
            **self.kernel_kwargs(),
        )

    def kernel_kwargs(self) -> dict:
        """The kernel options of `Actor.from_pretrained` / `ScalarModel.from_pretrained`, for every model of a run."""
        return dict(use_liger_kernel=self.use_liger_kernel, torch_compile=self.torch_compile)


@dataclass
class ModelConfig(ModelBuildConfig):
    """Model to train and how to build it."""

    pretrain: str = opt(
        None, "local HF model folder (or hub id where a hub is reachable) to start from", metavar="PATH"
    )


@dataclass(frozen=True)
class MuonSettings:
    """What DeepSpeed's Muon needs beyond the Adam settings: the matrices' learning rate, momentum and decay."""

    lr: float
    momentum: float
    weight_decay: float


@dataclass
class OptimizerChoice:
    """AdamW, or DeepSpeed's Muon for the weight matrices with AdamW for the rest (OpenRLHF >= 0.10, Molt)."""

    optim: str = opt(
        "adam",
        "adam = AdamW for every weight; muon = DeepSpeed's Muon (orthogonalised momentum) for the 2-D weights except "
        "embeddings, the LM head and a critic's or reward model's scalar head, AdamW at the Adam settings for those "
        "and the biases and norms",
        choices=("adam", "muon"),
    )
    muon_lr: float = opt(0.02, "--optim muon: learning rate of the Muon matrices (the Adam group keeps its own)")
    muon_momentum: float = opt(0.95, "--optim muon: momentum (Nesterov: DeepSpeed's Muon has no other)")
    muon_weight_decay: float = opt(None, "--optim muon: decoupled weight decay of the Muon matrices; default: --l2")
    muon_ns_steps: int = opt(
        5, "--optim muon: Newton-Schulz steps; DeepSpeed's Muon runs 5, the one value taken", choices=(5,)
    )

    def muon_settings(self, weight_decay: float) -> MuonSettings | None:
        """The Muon group's settings when `--optim muon`, else None (AdamW for everything)."""
        if self.optim != "muon":
            return None
        decay = weight_decay if self.muon_weight_decay is None else self.muon_weight_decay
        return MuonSettings(lr=self.muon_lr, momentum=self.muon_momentum, weight_decay=decay)


@dataclass
class OptimConfig(OptimizerChoice):
    """Batch arithmetic, optimiser and learning-rate schedule."""

    train_batch_size: int = opt(128, "global samples per optimizer step (all ranks, all micro-batches)")
    micro_train_batch_size: int = opt(8, "samples per forward/backward on one rank")
    max_epochs: int = opt(1, "passes over the training set")
    max_steps: int = opt(-1, "stop after this many optimizer steps; -1 = run all epochs")
    learning_rate: float = opt(5e-6, "peak learning rate")
    lr_scheduler: str = opt("cosine_with_min_lr", "learning-rate schedule after warm-up", choices=LR_SCHEDULERS)
    lr_warmup_ratio: float = opt(0.03, "share of the optimizer steps spent warming the LR up from 0")
    min_lr_ratio: float = opt(0.1, "floor of cosine_with_min_lr as a share of the peak LR")
    adam_betas: tuple[float, float] = opt((0.9, 0.95), "Adam beta1 beta2")
    adam_eps: float = opt(1e-8, "Adam epsilon (added to the root of the second moment)")
    l2: float = opt(0.0, "weight decay (not applied to biases and norms)")
    max_norm: float = opt(1.0, "gradient clipping norm; 0 disables")
    seed: int = opt(42, "random seed for data order, init and dropout")
    full_determinism: bool = opt(
        False, "deterministic kernels only (transformers' enable_full_determinism: slower; an op without one raises)"
    )


@dataclass
class CheckpointConfig:
    """Where the trained model and the resumable checkpoints go."""

    save_path: str = opt(
        "./ckpt", "final HF model folder; metrics.jsonl and run_info.json are written here too", metavar="DIR"
    )
    ckpt_path: str = opt(None, "DeepSpeed checkpoints (resumable); default: <save_path>/checkpoints", metavar="DIR")
    save_steps: int = opt(-1, "save a checkpoint every N optimizer steps; -1 = only at the end")
    load_checkpoint: bool = opt(False, "resume from the latest checkpoint in --ckpt_path if there is one")
    max_ckpt_num: int = opt(3, "keep at most this many checkpoints (oldest deleted first)")
    max_resumable_ckpt_num: int = opt(
        None,
        "keep at most this many resumable (DeepSpeed) checkpoints, which hold the optimizer state, while "
        "--max_ckpt_num still counts the HF exports of --save_hf_ckpt (default: --max_ckpt_num for both)",
    )
    max_ckpt_mem: float = opt(
        None, "GiB the kept checkpoints may take together (oldest deleted first; the newest is always kept)"
    )
    save_hf_ckpt: bool = opt(False, "also write an HF model folder next to each checkpoint")
    disable_ds_ckpt: bool = opt(False, "do not write DeepSpeed checkpoints (no resume possible)")
    disable_final_save: bool = opt(
        False, "do not export the trained model to --save_path at the end (the run's records still go there)"
    )

    def checkpoint_dir(self) -> str:
        """Where the resumable checkpoints are: --ckpt_path, else <save_path>/checkpoints."""
        return self.ckpt_path or str(Path(self.save_path) / "checkpoints")

    def resumable_keep(self) -> int:
        """How many resumable checkpoints are kept."""
        return self.max_ckpt_num if self.max_resumable_ckpt_num is None else self.max_resumable_ckpt_num


@dataclass
class LoggingConfig:
    """Metrics and experiment tracking."""

    logging_steps: int = opt(1, "log metrics every N optimizer steps")
    eval_steps: int = opt(-1, "evaluate every N optimizer steps; -1 = at the end of each epoch")
    use_wandb: str = opt(
        None,
        "log to Weights & Biases: an API key, or 'offline' (no network needed); "
        "bare flag = online if logged in, else offline",
        const="auto",
        metavar="KEY",
    )
    wandb_project: str = opt("openppo", "W&B project")
    wandb_run_name: str = opt(None, "W&B run name; default: <cli>_<time>")
    wandb_org: str = opt(None, "W&B entity (team or user) the run goes to; default: the logged-in user's")
    wandb_group: str = opt(None, "W&B group to file the run under (runs of one experiment side by side)")
    use_tensorboard: str = opt(None, "write TensorBoard event files to this folder", metavar="DIR")


def validate_build(model: ModelBuildConfig) -> None:
    """LoRA settings; raise UserError naming the flag."""
    require(model.lora_rank >= 0, f"--lora_rank must be >= 0, got {model.lora_rank}")
    if model.lora_rank > 0:
        require(model.lora_alpha > 0, f"--lora_alpha must be positive, got {model.lora_alpha}")
        require(0.0 <= model.lora_dropout < 1.0, f"--lora_dropout must be in [0, 1), got {model.lora_dropout}")
    require(model.aux_loss_coef >= 0, f"--aux_loss_coef must be >= 0, got {model.aux_loss_coef}")
    require(
        model.lm_head_chunk_tokens >= 0,
        f"--lm_head_chunk_tokens must be >= 0 (0 keeps the model's own logits), got {model.lm_head_chunk_tokens}",
    )


def validate_schedule(*, min_lr_ratio: float, max_norm: float) -> None:
    require(
        0.0 <= min_lr_ratio <= 1.0, f"--min_lr_ratio must be in [0, 1] (a share of the peak LR), got {min_lr_ratio}"
    )
    require(max_norm >= 0, f"--max_norm must be >= 0 (0 disables clipping), got {max_norm}")


def validate_outputs(ckpt: CheckpointConfig, logging: LoggingConfig) -> None:
    """The folders a run writes can be created, and a resume has checkpoints to read: checked before anything is
    written to --save_path."""
    require(
        ckpt.max_ckpt_mem is None or ckpt.max_ckpt_mem > 0,
        f"--max_ckpt_mem must be positive (GiB), got {ckpt.max_ckpt_mem}",
    )
    require(
        ckpt.max_resumable_ckpt_num is None or ckpt.max_resumable_ckpt_num > 0,
        f"--max_resumable_ckpt_num must be positive, got {ckpt.max_resumable_ckpt_num}",
    )
    if ckpt.load_checkpoint and ckpt.disable_ds_ckpt:
        raise UserError(
            "--load_checkpoint resumes from DeepSpeed checkpoints, which --disable_ds_ckpt turns off: drop one of them"
        )
    check_output_dir(ckpt.save_path, "--save_path")
    if ckpt.ckpt_path is not None:
        check_output_dir(ckpt.ckpt_path, "--ckpt_path")
    if logging.use_tensorboard is not None:
        check_output_dir(logging.use_tensorboard, "--use_tensorboard")
