"""Top-level configs of the supervised CLIs: each composes the shared components plus its own options."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from openppo.algorithms.losses import RM_LOSSES
from openppo.config.common import CheckpointConfig, LoggingConfig, ModelConfig, OptimConfig, value_head_prefix_opt
from openppo.config.schema import opt
from openppo.strategy.config import DeepSpeedConfig


@dataclass
class SupervisedDeepSpeedConfig(DeepSpeedConfig):
    """DeepSpeed ZeRO, precision and distributed settings, with the two ways ranks share rows."""

    ring_attn_size: int = opt(
        1, "ranks sharing each packed row (ring attention for long samples; needs --packing_samples)"
    )
    ring_head_stride: int = opt(1, "KV heads sent per ring step (bounds the buffers); 0 = all at once")
    ds_tensor_parallel_size: int = opt(
        1,
        "DeepSpeed AutoTP size: the trained model's weights are split over this many consecutive ranks, which "
        "train on the same rows (ZeRO <= 2)",
    )

    @property
    def replicas(self) -> int:
        """Consecutive ranks that hold the same rows (a ring, or an AutoTP group)."""
        return self.ring_attn_size * self.ds_tensor_parallel_size


@dataclass
class DataConfig:
    """Training data: files, mixing, templates and lengths."""

    dataset: str = opt(
        None, "comma list of local .json/.jsonl/.parquet/.csv files or save_to_disk folders", metavar="PATHS"
    )
    dataset_probs: str = opt(None, "comma list of sampling probabilities, one per --dataset source")
    eval_dataset: str = opt(None, "evaluation data, same formats as --dataset", metavar="PATHS")
    dataset_split: str = opt("train", "split of --dataset sources that are save_to_disk DatasetDict folders")
    eval_split: str = opt("train", "split of --eval_dataset sources that are save_to_disk DatasetDict folders")
    max_samples: int = opt(100_000_000, "use at most this many training samples (after mixing)")
    dataloader_num_workers: int = opt(0, "processes that collate training and eval batches; 0 = the trainer itself")
    max_len: int = opt(2048, "maximum tokens per sample (prompt + response); longer ones are truncated")
    input_key: str = opt("input", "column holding the prompt (a string or a list of chat messages)")
    input_template: str = opt(None, "Python format string with one {} for the prompt, e.g. 'User: {}\\nAssistant: '")
    apply_chat_template: bool = opt(False, "render prompts with the tokenizer's chat template")
    disable_fast_tokenizer: bool = opt(False, "use the model's slow (Python) tokenizer where it has one")
    tokenizer_chat_template: str = opt(
        None,
        "a Jinja chat template replacing the tokenizer's own (used with --apply_chat_template, saved with the model)",
    )


@dataclass
class SFTDataConfig(DataConfig):
    """Training data: files, mixing, templates and lengths."""

    output_key: str = opt("output", "column holding the response to learn")
    multiturn: bool = opt(False, "--input_key holds whole conversations; learn every assistant turn")
    train_on_last_turn_only: bool = opt(
        False, "with --multiturn: learn only each conversation's last assistant turn (the earlier ones are context)"
    )
    pretrain_mode: bool = opt(
        False, "--input_key holds plain text, used as is; every token is learned (no --output_key)"
    )
    packing_samples: bool = opt(False, "pack several samples into one row (no padding, no cross-attention)")
    image_key: str = opt(
        None,
        "a vision-language model: the column holding each sample's images, in the order of its prompt's "
        "{'type': 'image'} items (paths, data: URIs or base64; docs/vlm.md); default: text only",
    )
    max_images_per_prompt: int = opt(
        4, "with --image_key: images one sample may carry; rows with more are skipped and counted (Molt's default)"
    )


@dataclass
class SFTModelConfig(ModelConfig):
    """Model to train and how to build it."""

    freeze_visual_encoder: bool = opt(
        False, "a vision-language model: train its language model only; the vision tower and connector stay as loaded"
    )


@dataclass
class PreferenceDataConfig(DataConfig):
    """Preference data: prompt, chosen and rejected columns."""

    prompt_key: str = opt(None, "column holding the prompt; None when chosen/rejected are whole conversations")
    chosen_key: str = opt("chosen", "column holding the preferred response")
    rejected_key: str = opt("rejected", "column holding the dispreferred response")
    packing_samples: bool = opt(False, "run each micro-batch as one packed row: no padding is computed, same numbers")


@dataclass
class SFTConfig:
    openrlhf_cli: ClassVar[str] = "train_sft"

    model: SFTModelConfig = field(default_factory=SFTModelConfig)
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    ds: SupervisedDeepSpeedConfig = field(default_factory=SupervisedDeepSpeedConfig)
    ckpt: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


@dataclass
class RMOptions:
    """Reward-model loss."""

    loss: str = opt("sigmoid", "pairwise loss", choices=RM_LOSSES)
    margin: float = opt(0.0, "required score gap between chosen and rejected (sigmoid loss)")
    margin_loss: bool = opt(False, "take each pair's required score gap from the data's 'margin' column instead")
    compute_fp32_loss: bool = opt(False, "no effect: the scores are cast to fp32 before the loss in every run")
    value_head_prefix: str = value_head_prefix_opt()


@dataclass
class RMConfig:
    openrlhf_cli: ClassVar[str] = "train_rm"

    model: ModelConfig = field(default_factory=ModelConfig)
    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)
    rm: RMOptions = field(default_factory=RMOptions)
    optim: OptimConfig = field(default_factory=OptimConfig)
    ds: SupervisedDeepSpeedConfig = field(default_factory=SupervisedDeepSpeedConfig)
    ckpt: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


@dataclass
class DPOOptions:
    """DPO objective and its reference model."""

    ref_pretrain: str = opt(None, "reference model folder; default: --pretrain", metavar="PATH")
    beta: float = opt(0.1, "DPO temperature beta (strength of the KL tie to the reference)")
    ipo: bool = opt(False, "use the IPO loss instead of DPO")
    label_smoothing: float = opt(0.0, "cDPO: assumed share of flipped preference labels, in [0, 0.5)")
    nll_loss_coef: float = opt(0.0, "weight of an NLL term on the chosen responses (0 = off)")
    ref_offload: bool = opt(False, "offload the reference model's weights to CPU (ZeRO-3 param offload)")


@dataclass
class DPOConfig:
    openrlhf_cli: ClassVar[str] = "train_dpo"

    model: ModelConfig = field(default_factory=ModelConfig)
    data: PreferenceDataConfig = field(default_factory=PreferenceDataConfig)
    dpo: DPOOptions = field(default_factory=DPOOptions)
    optim: OptimConfig = field(default_factory=OptimConfig)
    ds: SupervisedDeepSpeedConfig = field(default_factory=SupervisedDeepSpeedConfig)
    ckpt: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
