"""The DeepSpeed training strategy: builds engines, steps them, saves and restores them.

One object per process. The trainers only talk to this interface (`prepare_train`, `prepare_eval`, `step_guard`,
`zero3_init`, `all_reduce_mean`, `save_checkpoint`, `load_checkpoint`, `save_hf`), so another backend could
stand behind the same calls.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from openppo.config.common import MuonSettings
from openppo.errors import UserError
from openppo.strategy import checkpoint as ckpt
from openppo.strategy.config import DeepSpeedConfig, eval_ds_config, train_ds_config
from openppo.strategy.distributed import init_distributed
from openppo.strategy.step_guard import StepGuard
from openppo.utils.hardware import keep_freed_host_memory

logger = logging.getLogger(__name__)


def deepspeed_arch_list(value: str) -> str:
    """TORCH_CUDA_ARCH_LIST as DeepSpeed's JIT op builder can read it: "9.0a;10.0f+PTX" -> "9.0;10.0+PTX".

    PyTorch accepts the architecture-specific (`a`) and family (`f`) entries that CUDA images set, but DeepSpeed
    0.19's builder reads every part of an entry as an integer and stops at them ("invalid literal for int() with
    base 10: '0a'", seen on an H200 image). Its Adam kernels use no architecture-specific instruction, so the plain
    capability builds the same op."""
    entries = (re.sub(r"(?<=\d)[af](?=\+|$)", "", e.strip()) for e in value.replace(" ", ";").split(";"))
    return ";".join(dict.fromkeys(e for e in entries if e))


def readable_cuda_arch_list() -> None:
    """Rewrite TORCH_CUDA_ARCH_LIST in this process's environment so that DeepSpeed can build its CUDA ops."""
    value = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if value and (fixed := deepspeed_arch_list(value)) != value:
        logger.info("TORCH_CUDA_ARCH_LIST=%r read as %r for DeepSpeed's op builds", value, fixed)
        os.environ["TORCH_CUDA_ARCH_LIST"] = fixed


def set_seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _param_groups(model: nn.Module, weight_decay: float, muon: MuonSettings | None = None) -> list[dict]:
    """Weight decay on matrices only: biases and norm weights (1-D) are exempt. With Muon its matrices form a group
    of their own, with Muon's decay."""
    decay, no_decay, matrices = [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        ndim = len(getattr(p, "ds_shape", p.shape))  # ZeRO-3 params are flattened shards
        if muon is not None and muon_trains(name, ndim):
            matrices.append(p)
        else:
            (decay if ndim >= 2 and "norm" not in name else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if muon is not None:
        groups.insert(0, {"params": matrices, "weight_decay": muon.weight_decay})
    # ZeRO drops empty groups (LoRA has no 1-D trainable params); the LR scheduler must see the same groups.
    return [g for g in groups if g["params"]]


SCALAR_HEADS = ("score", "value_head", "classifier")
"""Module names of the scalar heads of critics and reward models (HF's `*ForSequenceClassification` use `score`)."""


def muon_trains(name: str, ndim: int) -> bool:
    """Whether Muon takes a parameter: a hidden matrix, not an embedding, the LM head or a scalar head. DeepSpeed's
    own rule (`deepspeed.set_optimizer_flags`) stops at the first two, so a critic's or reward model's 1-row value
    head took Muon: its update was the gradient's direction at Muon's learning rate whatever the gradient's size
    (0.02 of norm a step, where AdamW at 9e-6 moves a 896-wide head by about 3e-4). Muon's authors give classifier
    heads to AdamW with the embeddings; `_muon_tags` applies this rule in place of DeepSpeed's."""
    lowered = name.lower()
    if ndim < 2 or "embed" in lowered or "lm_head" in lowered:
        return False
    return not any(part in SCALAR_HEADS for part in lowered.split("."))


@contextlib.contextmanager
def _muon_tags():
    """Within `deepspeed.initialize`, tag each parameter's `use_muon` by `muon_trains` after DeepSpeed tags it by
    its own rule: DeepSpeed reads the tag when it splits the groups into Muon and Adam halves, and tags every
    parameter afresh inside `initialize`, so a tag set beforehand would be overwritten."""
    import deepspeed

    own = deepspeed.set_optimizer_flags

    def tag(config_class, model: nn.Module) -> None:
        own(config_class, model)
        for name, p in model.named_parameters():
            if getattr(p, "use_muon", False) and not muon_trains(name, len(getattr(p, "ds_shape", p.shape))):
                p.use_muon = False

    deepspeed.set_optimizer_flags = tag
    try:
        yield
    finally:
        deepspeed.set_optimizer_flags = own


def muon_optimizer_config(
    muon: MuonSettings, *, lr: float, betas: tuple[float, float], eps: float, on_gpu: bool
) -> dict:
    """DeepSpeed's `optimizer` entry for Muon: `muon_lr` for the matrices and `adam_lr` for the AdamW half (without
    them both halves would take `lr`); the weight decay of each group comes with the group. On CPU the AdamW half is
    torch's (`torch_adam`), as in AdamW runs: DeepSpeed's default there, FusedAdam, JIT-builds a CPU op first (two
    C++ files, 173 CPU-seconds on a 2-core AMD EPYC)."""
    params = {"lr": lr, "muon_lr": muon.lr, "adam_lr": lr, "momentum": muon.momentum, "betas": list(betas), "eps": eps}
    if not on_gpu:
        params["torch_adam"] = True
    return {"type": "Muon", "params": params}


class DeepSpeedStrategy:
    """Distributed set-up and DeepSpeed engines for one process (one rank)."""

    def __init__(
        self,
        cfg: DeepSpeedConfig,
        *,
        train_batch_size: int,
        micro_batch_size: int,
        max_norm: float,
        seed: int,
        tensor_parallel_size: int = 1,
        full_determinism: bool = False,
    ):
        self.cfg = cfg
        if cfg.param_dtype == "auto":  # the CLIs resolve it up front; a strategy built directly resolves it here
            from openppo.utils.hardware import resolve_precision

            resolve_precision(cfg)
        self.tensor_parallel_size = tensor_parallel_size  # AutoTP: consecutive ranks split the trained weights
        self.train_batch_size = train_batch_size
        self.micro_batch_size = micro_batch_size
        self.max_norm = max_norm
        self.seed = seed
        self.full_determinism = full_determinism  # --full_determinism: deterministic kernels on this rank
        self.on_gpu = torch.cuda.is_available()
        self.rank = 0
        self.world_size = 1
        self._hf_ds_config: Any = None

    # ----------------------------------------------------------------------------------------------- set-up
    def setup_distributed(self) -> None:
        validate_precision(self.cfg.param_dtype, self.on_gpu)
        self.rank, self.world_size = init_distributed(self.cfg.dist_timeout)
        validate_batch_sizes(self.train_batch_size, self.micro_batch_size, self.world_size)
        set_seed(self.seed)
        if self.full_determinism:
            from transformers import enable_full_determinism

            enable_full_determinism(self.seed)  # seeds, deterministic torch/cuDNN/cuBLAS kernels

    @property
    def is_rank0(self) -> bool:
        return self.rank == 0

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", torch.cuda.current_device()) if self.on_gpu else torch.device("cpu")

    @property
    def torch_dtype(self) -> torch.dtype:
        return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[self.cfg.param_dtype]

    @property
    def grad_accum_steps(self) -> int:
        return self.train_batch_size // (self.micro_batch_size * self.world_size)

    def train_config(self) -> dict:
        return train_ds_config(
            self.cfg,
            train_batch_size=self.train_batch_size,
            micro_batch_size=self.micro_batch_size,
            world_size=self.world_size,
            max_norm=self.max_norm,
            on_gpu=self.on_gpu,
            tensor_parallel_size=self.tensor_parallel_size,
        )

    @contextlib.contextmanager
    def zero3_init(self, for_training: bool = True, offload: bool = False) -> Iterator[None]:
        """Context for `from_pretrained` so ZeRO-3 partitions weights while loading instead of after."""
        if self.cfg.zero_stage != 3:
            yield
            return
        from transformers.integrations import HfDeepSpeedConfig

        config = (
            self.train_config()
            if for_training
            else eval_ds_config(
                self.cfg,
                micro_batch_size=self.micro_batch_size,
                world_size=self.world_size,
                offload=offload,
                on_gpu=self.on_gpu,
            )
        )
        # transformers keeps only a weak reference to this object: hold it while loading.
        holder = HfDeepSpeedConfig(config)
        try:
            yield
        finally:
            del holder

    # ----------------------------------------------------------------------------------------------- engines
    def _optimizer(self, model: nn.Module, lr: float, betas: tuple[float, float], weight_decay: float, eps: float):
        groups = _param_groups(model, weight_decay)
        if self.on_gpu:
            from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

            cls = DeepSpeedCPUAdam if self.cfg.adam_offload else FusedAdam
            readable_cuda_arch_list()  # before the op's first use, which JIT-builds it
            return cls(groups, lr=lr, betas=betas, eps=eps)
        # On CPU torch's AdamW needs no JIT build, and its fused kernel is several times faster than the default
        # per-tensor loop (docs/benchmarks.md, "Measurements behind code defaults").
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True)

    def prepare_train(
        self,
        model: nn.Module,
        *,
        lr: float,
        betas: tuple[float, float],
        weight_decay: float,
        scheduler: str,
        warmup_ratio: float,
        min_lr_ratio: float,
        num_training_steps: int,
        eps: float = 1e-8,
        muon: MuonSettings | None = None,
    ):
        """Wrap a trainable model in a DeepSpeed engine with AdamW (or Muon, `muon` given) and an LR schedule."""
        import deepspeed
        from transformers import get_scheduler

        if not self.on_gpu:  # a CPU rank's activations and gradients are host memory, made again every micro-batch
            keep_freed_host_memory()
        kwargs = {"min_lr_rate": min_lr_ratio} if scheduler == "cosine_with_min_lr" else {}

        def schedule(optimizer):  # scales each group's own starting LR, so Muon's and Adam's keep their ratio
            return get_scheduler(
                scheduler,
                optimizer,
                num_warmup_steps=int(warmup_ratio * num_training_steps),
                num_training_steps=max(1, num_training_steps),
                scheduler_specific_kwargs=kwargs,
            )

        config = self.train_config()
        if muon is None:
            optimizer = self._optimizer(model, lr, betas, weight_decay, eps)
            groups, lr_scheduler = None, schedule(optimizer)
        else:  # DeepSpeed builds Muon itself: its ZeRO stages orthogonalise whole matrices across the partitions
            config["optimizer"] = muon_optimizer_config(muon, lr=lr, betas=betas, eps=eps, on_gpu=self.on_gpu)
            # ZeRO-3 refuses Muon with reduce-scatter ("cannot be used together"): the gradients are all-reduced
            config["zero_optimization"]["reduce_scatter"] = False
            optimizer, groups, lr_scheduler = None, _param_groups(model, weight_decay, muon), schedule
            if self.on_gpu:  # its Adam half is DeepSpeed's FusedAdam (CPUAdam with --adam_offload), JIT-built
                readable_cuda_arch_list()
        with _muon_tags() if muon is not None else contextlib.nullcontext():
            engine, *_ = deepspeed.initialize(
                model=model,
                optimizer=optimizer,
                model_parameters=groups,
                lr_scheduler=lr_scheduler,
                config=config,
                dist_init_required=False,
            )
        if getattr(self.cfg, "deepcompile", False):  # GPU only (validated): compiled on the first forward
            engine.compile()
        return engine

    def prepare_eval(self, model: nn.Module, offload: bool = False):
        """Wrap a frozen model (reference, reward) for inference; ZeRO-3 shards it when zero_stage is 3."""
        import deepspeed

        config = eval_ds_config(
            self.cfg,
            micro_batch_size=self.micro_batch_size,
            world_size=self.world_size,
            offload=offload,
            on_gpu=self.on_gpu,
        )
        model.requires_grad_(False)
        engine, *_ = deepspeed.initialize(model=model, config=config, dist_init_required=False)
        engine.eval()
        return engine

    def step_guard(self, engine, model: str, metric: str = "train/skipped_steps") -> StepGuard:
        """`backward`/`step` of a trained engine that skip steps with a NaN/Inf loss or gradient and stop the run
        after more than --max_nonfinite_steps in a row (see openppo.strategy.step_guard)."""
        return StepGuard(engine, model=model, max_consecutive=self.cfg.max_nonfinite_steps, metric=metric)

    # ----------------------------------------------------------------------------------------------- comms
    def all_reduce_mean(self, values: dict[str, float]) -> dict[str, float]:
        """Average scalar metrics over ranks (one collective for all of them)."""
        if self.world_size == 1 or not values:
            return dict(values)
        keys = sorted(values)
        t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(t)
        return {k: v / self.world_size for k, v in zip(keys, t.tolist())}

    def all_reduce_sum(self, value: float) -> float:
        if self.world_size == 1:
            return float(value)
        t = torch.tensor([float(value)], dtype=torch.float64, device=self.device)
        torch.distributed.all_reduce(t)
        return float(t.item())

    def barrier(self) -> None:
        if self.world_size > 1:
            torch.distributed.barrier()

    # ----------------------------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self, engine, ckpt_dir: str, step: int, client_state: dict) -> None:
        """Write this model's `global_step<step>` folder (collective: every rank calls it). It is one part of a
        checkpoint: resumable only after the caller commits the step (`checkpoint.commit`) once all parts are saved."""
        tag = ckpt.tag_for_step(step)
        if self.is_rank0:
            ckpt.write_json_atomic(Path(ckpt_dir) / tag / "client_state.json", client_state)
        self.barrier()
        engine.save_checkpoint(ckpt_dir, tag=tag, client_state=client_state)
        # DeepSpeed does not fsync; every rank flushes the folder (on a shared file system only the writer's own
        # fsync persists a file, locally the second one finds nothing left to write)
        ckpt.fsync_tree(Path(ckpt_dir) / tag)
        self.barrier()

    def load_checkpoint(self, engine, ckpt_dir: str, step: int, load_optimizer: bool = True) -> None:
        """Restore this model from the `global_step<step>` folder of a committed step (`checkpoint.resolve`); the
        tag is named explicitly because DeepSpeed's `latest` file may point at a save cut short."""
        path, _ = engine.load_checkpoint(
            ckpt_dir,
            tag=ckpt.tag_for_step(step),
            load_optimizer_states=load_optimizer,
            load_lr_scheduler_states=load_optimizer,
        )
        if path is None:
            raise UserError(
                f"--load_checkpoint: could not load step {step} from {ckpt_dir}; delete that folder "
                f"to start fresh or point --ckpt_path at a valid one"
            )

    def save_committed(
        self, engine, ckpt_dir: str, step: int, state: dict, max_num: int, max_bytes: float | None = None
    ) -> None:
        """A checkpoint with this engine as its only part (the supervised trainers): clear what an interrupted save
        of this step left, save, commit, rotate. Collective; rank 0 keeps the books."""
        if self.is_rank0:
            ckpt.begin_save(ckpt_dir, step, [ckpt.SINGLE_PART])
        self.save_checkpoint(engine, ckpt_dir, step, state)
        if self.is_rank0:
            ckpt.commit(ckpt_dir, step, [ckpt.SINGLE_PART], state)
            removed = ckpt.rotate(ckpt_dir, max_num, step, [ckpt.SINGLE_PART], max_bytes)
            if removed:
                logger.info("removed old checkpoints %s", ", ".join(removed))

    def load_committed(self, engine, ckpt_dir: str) -> dict | None:
        """Restore the newest committed step of a one-part checkpoint; its saved state, or None (a fresh start)."""
        commit = ckpt.resolve(ckpt_dir)
        if commit is None:
            return None
        if commit.parts != (ckpt.SINGLE_PART,):
            raise UserError(
                f"--load_checkpoint: {ckpt_dir} holds a checkpoint of parts {list(commit.parts)} (an RL "
                f"run's?); point --ckpt_path at this trainer's checkpoints"
            )
        self.load_checkpoint(engine, ckpt_dir, commit.step)
        return commit.state

    def gathered_state_dict(self, engine_or_model) -> dict[str, torch.Tensor] | None:
        """Full (unsharded) state dict on rank 0, None elsewhere. Collective under ZeRO-3."""
        module = getattr(engine_or_model, "module", engine_or_model)
        if self.cfg.zero_stage == 3 and hasattr(engine_or_model, "_zero3_consolidated_16bit_state_dict"):
            state = engine_or_model._zero3_consolidated_16bit_state_dict()
        elif self.tensor_parallel_size > 1 and hasattr(engine_or_model, "_consolidated_16bit_state_dict"):
            state = engine_or_model._consolidated_16bit_state_dict()  # gathers the AutoTP shards layer by layer
        else:
            state = {k: v.detach().cpu() for k, v in module.state_dict().items()} if self.is_rank0 else None
        return state if self.is_rank0 else None

    def save_hf(
        self, engine_or_model, tokenizer, out_dir: str | Path, extra_config: dict[str, Any] | None = None
    ) -> None:
        """Export an HF folder (adapter only for LoRA models) from rank 0; all ranks must call it."""
        from openppo.models.hf import save_hf_folder

        state = self.gathered_state_dict(engine_or_model)
        if self.is_rank0:
            save_hf_folder(getattr(engine_or_model, "module", engine_or_model), state, tokenizer, out_dir, extra_config)
        self.barrier()


def validate_precision(param_dtype: str, on_gpu: bool) -> None:
    if param_dtype == "fp16" and not on_gpu:
        from openppo.utils.hardware import auto_param_dtype

        raise UserError(
            f"--param_dtype fp16: DeepSpeed has no fp16 on CPU; use --param_dtype auto (here: {auto_param_dtype()})"
        )


def validate_batch_sizes(train_batch_size: int, micro_batch_size: int, world_size: int) -> None:
    if micro_batch_size <= 0 or train_batch_size <= 0:
        raise UserError("--train_batch_size and --micro_train_batch_size must be positive")
    if train_batch_size % (micro_batch_size * world_size) != 0:
        raise UserError(
            f"--train_batch_size {train_batch_size} is not a multiple of --micro_train_batch_size "
            f"{micro_batch_size} x {world_size} ranks; pick a --train_batch_size that is"
        )
