"""The ranks of the RL model groups: each Ray actor of a `WorkerGroup` is one of these workers.

A worker owns its DeepSpeed engine and answers the driver's calls on this rank's share of the batch (the driver's
typed handles are in `openppo.ppo.groups`):
- `ActorWorker`: the trained policy; old log-probs, PPO update, weight sync to the engines, checkpoints, HF export.
- `CriticWorker`: the trained value model (gae only); values, value update.
- `ReferenceWorker`: frozen actor copy; reference log-probs for the KL term.
- `RewardWorker`: frozen reward model; one score per sequence.
- `TeacherWorker`: a frozen distillation teacher; its log-probs of the student's samples.
`setup(cfg, role)` builds the model, with the role's slice of the run plan (`openppo.ppo.plan`), once the group's
process group can form (the driver calls it on every rank at once); a
worker also runs in-process, without Ray (tests), by calling `setup` itself. Calls take and return CPU tensors.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from openppo.distributed.worker import BaseWorker
from openppo.models.actor import Actor, prompt_lengths, use_chunked_head
from openppo.models.row_layout import RowLayout, ring_layout
from openppo.models.scalar import ScalarModel, last_token_index
from openppo.ppo.batching import ForwardChunks, forward_batching, train_batching
from openppo.ppo.config import PPOConfig
from openppo.ppo.fit import WeightAverage, actor_loss, critic_loss, fit_experience
from openppo.ppo.plan import RolePlan
from openppo.ppo.reporting import mfu, peak_flops, train_flops
from openppo.strategy.checkpoint import tag_for_step
from openppo.strategy.config import state_offload_supported
from openppo.strategy.deepspeed_strategy import DeepSpeedStrategy
from openppo.utils.hardware import device_name, device_stats, trim_host_heap
from openppo.utils.images import BATCH_KEY as IMAGES
from openppo.utils.transfer import host_tensor

logger = logging.getLogger(__name__)


def make_strategy(cfg: PPOConfig, role: RolePlan) -> DeepSpeedStrategy:
    """A strategy whose batch arithmetic is the training one (frozen models only use the micro size)."""
    t = cfg.train
    if role.optimizer_steps:
        # DeepSpeed counts every rank as a replica; the ranks of a ring or a tensor-parallel group share their rows.
        return DeepSpeedStrategy(
            cfg.ds,
            train_batch_size=t.train_batch_size * role.replicas,
            micro_batch_size=t.micro_train_batch_size,
            max_norm=t.max_norm,
            seed=t.seed,
            tensor_parallel_size=role.tensor_parallel,
            full_determinism=t.full_determinism,
        )
    # Frozen models never step an optimizer; DeepSpeed still wants batch sizes that divide over the ranks.
    micro = cfg.rollout.micro_rollout_batch_size
    return DeepSpeedStrategy(
        cfg.ds,
        train_batch_size=micro * role.ranks,
        micro_batch_size=micro,
        max_norm=t.max_norm,
        seed=t.seed,
        full_determinism=t.full_determinism,
    )


def _set_layout(cfg: PPOConfig, role: RolePlan, model: Actor | ScalarModel) -> None:
    """The model's row layout for the whole run (collective with --ring_attn_size: all ranks call it)."""
    r = cfg.rollout
    if r.ring_attn_size > 1:
        model.layout = ring_layout(model.model, r.ring_attn_size, r.ring_head_stride)
    else:
        model.layout = RowLayout(packed=r.packing_samples, share_prompts=role.share_prompts)
    if isinstance(model, Actor):  # (the critic and reward model have scalar heads)
        use_chunked_head(model, cfg.model.lm_head_chunk_tokens)


def _prompt_lens(batch: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The rows' prompt lengths, for a shared-prompt layout (the scalar models take them; the actor reads its score
    mask), from the host's copy of the mask: the layout is read there, without waiting on the GPU."""
    return prompt_lengths(host_tensor(batch, "action_mask")) if "action_mask" in batch else None


def _optimizer_kwargs(cfg: PPOConfig, lr: float, num_training_steps: int) -> dict:
    t = cfg.train
    return dict(
        lr=lr,
        betas=cfg.ds.adam_betas,
        eps=cfg.ds.adam_eps,
        weight_decay=cfg.ds.l2,
        scheduler=t.lr_scheduler,
        warmup_ratio=t.lr_warmup_ratio,
        min_lr_ratio=t.min_lr_ratio,
        num_training_steps=num_training_steps,
        muon=cfg.ds.muon_settings(cfg.ds.l2),
    )


def _num_params(model) -> int:
    """Parameters of the whole model (ZeRO-3 keeps only a shard in each tensor and the full size in ds_numel)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())


class _TrainedWorker(BaseWorker):
    """Checkpoints, HF export, state offload and update throughput, shared by the actor and critic ranks (every
    rank calls each: they are collectives)."""

    strategy: DeepSpeedStrategy
    engine: object
    cfg: PPOConfig
    role: RolePlan
    num_params: int

    def _perf(
        self, name: str, metrics: dict[str, float], data: dict[str, torch.Tensor], seconds: float
    ) -> dict[str, float]:
        """The update's `metrics` with every perf/* figure named perf/<name>_* (the actor's and the critic's are
        logged side by side): the update's padding and micro-batch counts, this rank's memory, and on a known GPU
        the update's MFU (averaged over the ranks by the caller: each rank counts 1/replicas of the tokens it shares
        with its ring or tensor-parallel group)."""
        trim_host_heap()  # at most once a minute: the update's freed host memory goes back before the RSS is read
        out = {k: v for k, v in metrics.items() if not k.startswith("perf/")}
        perf = {**{k: v for k, v in metrics.items() if k.startswith("perf/")}, **device_stats()}
        out.update({f"perf/{name}_{k.removeprefix('perf/')}": v for k, v in perf.items()})
        tokens = int(data["attention_mask"].sum()) * self.cfg.train.epochs(name) / self.role.replicas
        peak = peak_flops(device_name(), self.cfg.ds.param_dtype) if torch.cuda.is_available() else None
        value = mfu(train_flops(self.num_params, tokens, self.cfg.model.gradient_checkpointing), seconds, peak)
        if value is not None:
            out[f"perf/{name}_mfu"] = value
        return out

    def save_checkpoint(self, ckpt_dir: str, step: int, client_state: dict) -> None:
        self.strategy.save_checkpoint(self.engine, ckpt_dir, step, client_state)

    def load_checkpoint(self, ckpt_dir: str, step: int) -> None:
        self.strategy.load_checkpoint(self.engine, ckpt_dir, step)

    def save_hf(self, out_dir: str | Path, tokenizer_path: str) -> None:
        from openppo.models.hf import load_tokenizer

        self.strategy.save_hf(self.engine, load_tokenizer(tokenizer_path), out_dir)

    def _can_offload(self) -> bool:
        return state_offload_supported(self.strategy.cfg.zero_stage, torch.cuda.is_available())

    def offload_states(self) -> bool:
        """Move optimizer, gradient and parameter states off the device (--deepspeed_enable_sleep); False where
        DeepSpeed cannot (see `state_offload_supported`)."""
        if self._can_offload():
            self.engine.offload_states(pin_memory=torch.cuda.is_available())
        return self._can_offload()

    def reload_states(self) -> bool:
        if self._can_offload():
            self.engine.reload_states()
        return self._can_offload()


class ActorWorker(_TrainedWorker):
    """One rank of the actor group; rank 0 (and, in the hybrid engine, the ranks on engine workers' devices) also
    sends the weights to the engines."""

    transfer = None  # openppo.rollout.sender.TrainerTransfer, set by connect_engines
    ema: WeightAverage | None = None  # --enable_ema

    def setup(self, cfg: PPOConfig, role: RolePlan) -> None:
        self.cfg, self.role = cfg, role
        self.strategy = make_strategy(cfg, role)
        self.strategy.setup_distributed()
        with self.strategy.zero3_init():
            model = Actor.from_pretrained(
                cfg.model.pretrain,
                dtype=self.strategy.torch_dtype,
                freeze_visual_encoder=cfg.model.freeze_visual_encoder,
                **cfg.model.build_kwargs(),
            )
        _set_layout(cfg, role, model)
        self.num_params = _num_params(model)
        if cfg.train.enable_ema:
            # Read before DeepSpeed splits the model: an AutoTP gather before the first optimizer step leaves the
            # parameters apart from ZeRO-1/2's flat buffer, which a resume's load would then not reach (measured:
            # the resumed actor computed with its initial weights after the next state reload).
            self.ema = WeightAverage(model, cfg.train.ema_beta, self.strategy.rank)
        self.engine = self.strategy.prepare_train(
            model, **_optimizer_kwargs(cfg, cfg.train.actor_learning_rate, role.optimizer_steps)
        )
        self.guard = self.strategy.step_guard(self.engine, "actor", "train/actor_skipped_steps")
        # --ds_tensor_parallel_size: the share of the model's weights this rank holds after AutoTP split them
        self.weight_share = sum(p.numel() for p in self.engine.module.parameters()) / max(self.num_params, 1)

    @torch.no_grad()
    def log_probs(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        """Per-token log-probs [B, T-1] of the sequences at the rollout temperature (fp32, CPU)."""
        temperature = self.cfg.rollout.temperature
        chunks = ForwardChunks(self.engine, self.strategy, data, forward_batching(self.cfg, self.role.share_prompts))
        for b in chunks:
            out = self.engine(
                b["sequences"],
                host_tensor(b, "attention_mask"),  # the layout read from the host (Actor.forward)
                temperature=temperature,
                score_mask=host_tensor(b, "action_mask") if "action_mask" in b else None,
                images=b.get(IMAGES),
            )
            chunks.add(out.log_probs)
        return chunks.result()

    @torch.no_grad()
    def log_probs_and_sampling(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        """[B, T-1, 2]: `log_probs`, and from the same forwards the log-probs under the engine's top-k/top-p
        truncation (`openppo.algorithms.sampling`), which compare with the engine's own."""
        r = self.cfg.rollout
        chunks = ForwardChunks(self.engine, self.strategy, data, forward_batching(self.cfg, self.role.share_prompts))
        for b in chunks:
            out = self.engine(
                b["sequences"],
                host_tensor(b, "attention_mask"),
                temperature=r.temperature,
                score_mask=host_tensor(b, "action_mask") if "action_mask" in b else None,
                sampling=r.sampling,
                images=b.get(IMAGES),
            )
            chunks.add(torch.stack([out.log_probs, out.sampling_log_probs], dim=-1))
        return chunks.result()

    def train(self, data: dict[str, torch.Tensor], kl_coef: float, global_step: int) -> dict[str, float]:
        cfg = self.cfg
        # async samples come from an older policy than the one scoring them: always importance-weighted
        is_correction = (
            cfg.vllm.vllm_is_correction_type
            if (cfg.vllm.enable_vllm_is_correction or cfg.rollout.async_train)
            else None
        )
        loss_fn = actor_loss(
            self.engine,
            cfg.algo,
            kl_coef=kl_coef,
            temperature=cfg.rollout.temperature,
            generate_max_len=cfg.data.generate_max_len,
            is_correction=is_correction,
            is_threshold=tuple(cfg.vllm.vllm_is_truncated_threshold),
            sampling=cfg.rollout.sampling,
            aux_loss_coef=cfg.model.aux_loss_coef,
        )
        start = time.perf_counter()
        metrics = fit_experience(
            self.engine,
            data,
            loss_fn,
            batching=train_batching(cfg, self.role.share_prompts),
            rows_per_step=cfg.train.step_rows(self.role.rows_per_step, data["sequences"].size(0)),
            epochs=cfg.train.max_epochs,
            world_size=self.strategy.world_size,
            seed=cfg.train.seed + 1000 * global_step,
            device=self.strategy.device,
            ring_size=self.role.ring,
            tensor_parallel_size=self.role.tensor_parallel,
            guard=self.guard,
            after_step=self.ema.update if self.ema is not None else None,
        )
        metrics["train/actor_lr"] = self.engine.get_lr()[0]
        ring = self.engine.module.layout.ring
        if ring is not None:
            metrics["perf/ring_token_share"] = ring.token_share()
        if self.strategy.tensor_parallel_size > 1:
            metrics["perf/weight_share"] = self.weight_share
        return self.strategy.all_reduce_mean(self._perf("actor", metrics, data, time.perf_counter() - start))

    def save_hf(self, out_dir: str | Path, tokenizer_path: str) -> None:
        """With --enable_ema every HF export of the actor is the weights' average (as OpenRLHF's)."""
        if self.ema is None:
            return super().save_hf(out_dir, tokenizer_path)
        from openppo.models.hf import load_tokenizer, save_hf_folder

        if self.strategy.is_rank0:
            model = self.engine.module.model
            save_hf_folder(model, self.ema.state(self.strategy.torch_dtype), load_tokenizer(tokenizer_path), out_dir)
        self.strategy.barrier()

    def save_checkpoint(self, ckpt_dir: str, step: int, client_state: dict) -> None:
        if self.ema is not None and self.strategy.is_rank0:  # the average, beside DeepSpeed's files of the step
            path = Path(ckpt_dir) / tag_for_step(step) / "ema.pt"
            path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(self.ema.state_dict(), path.with_suffix(".tmp"))
            path.with_suffix(".tmp").replace(path)
        super().save_checkpoint(ckpt_dir, step, client_state)

    def load_checkpoint(self, ckpt_dir: str, step: int) -> None:
        super().load_checkpoint(ckpt_dir, step)
        if self.ema is None:
            return
        path = Path(ckpt_dir) / tag_for_step(step) / "ema.pt"
        if path.exists():  # (every rank sees the checkpoint folder)
            if self.strategy.is_rank0:
                self.ema.load_state_dict(torch.load(path, weights_only=True))
            return
        if self.strategy.is_rank0:
            logger.warning("--enable_ema: the checkpoint has no average; it starts from the resumed weights")
        self.ema.restart()  # a collective under ZeRO-3 and AutoTP: every rank enters

    def connect_engines(
        self,
        engines: list[Any],
        plan: Any,
        backend: str,
        tensor_parallel_size: int,
        timeout_s: float,
        bucket_bytes: int,
        engine_dtype: str,
        delta: bool = False,
    ) -> None:
        """Every rank enters `TrainerTransfer.trainer_init`: with `plan` (a `SyncPlan`) handing engines their buckets
        from several ranks, all ranks make the exchange group (a collective); rank 0 joins the broadcast group with
        the workers of the engines that get buckets by broadcast. Each sync sends buckets of `bucket_bytes` in
        `engine_dtype`, only the changed elements after the first with `delta`."""
        from openppo.rollout.sender import TrainerInit, TrainerTransfer

        if getattr(self, "transfer", None) is not None:  # connecting anew after an engine was replaced
            self.transfer.shutdown()
        init = TrainerInit(
            rank=self.strategy.rank,
            plan=plan,
            group_backend=backend,
            tensor_parallel_size=tensor_parallel_size,
            bucket_bytes=bucket_bytes,
            dtype=getattr(torch, engine_dtype),  # vLLM's names are torch's
            timeout_s=timeout_s,
            delta=delta,
        )
        self.transfer = TrainerTransfer.trainer_init(init, client=engines, source=self.engine.module)

    def sync_weights(self, version: int) -> dict[str, Any] | None:
        """Every rank enters (ZeRO-3 gathers are collectives); rank 0 sends and returns the stats. The engines
        tag the tokens they sample from then on with `version`.

        A sync that fails on rank 0 (which alone talks to the engines) returns `{"failed": traceback}` instead of
        raising: the cause may be an engine that died, which the driver replaces before it syncs again, and a
        raised error would end the actor group (`WorkerGroup` shuts a group down at the first failed call). The
        other ranks went through the sync with rank 0 all the same (`TrainerTransfer.send_weights`)."""
        import traceback

        try:
            out = self.transfer.send_weights(version=version)
        except Exception:
            return {"failed": traceback.format_exc()}
        finally:
            trim_host_heap()  # the buckets just freed
        return out

    def check_engine_weights(self, engines: list[Any], timeout_s: float) -> list[tuple[bool, str]]:
        """Every rank enters (the gathers are collectives); rank 0 returns per engine (equal, summary): each tensor
        the engine computes with against this trainer's gathered copy (`openppo.rollout.readback`)."""
        from openppo.rollout.readback import engine_weight_checks

        checks = engine_weight_checks(self.engine.module, engines, self.strategy.rank, timeout_s)
        return [(c.ok(), c.summary()) for c in checks]


class CriticWorker(_TrainedWorker):
    def setup(self, cfg: PPOConfig, role: RolePlan) -> None:
        self.cfg, self.role = cfg, role
        self.strategy = make_strategy(cfg, role)
        self.strategy.setup_distributed()
        path = cfg.model.critic_pretrain or cfg.model.reward_pretrain or cfg.model.pretrain
        with self.strategy.zero3_init():
            model = ScalarModel.from_pretrained(
                path, dtype=self.strategy.torch_dtype, flag="--critic_pretrain", **cfg.model.build_kwargs()
            )
        _set_layout(cfg, role, model)
        self.num_params = _num_params(model)
        self.engine = self.strategy.prepare_train(
            model, **_optimizer_kwargs(cfg, cfg.train.critic_learning_rate, role.optimizer_steps)
        )
        self.guard = self.strategy.step_guard(self.engine, "critic", "train/critic_skipped_steps")

    @torch.no_grad()
    def values(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        """V(s_t) on the [B, T-1] action grid: the value at position t is that of the state before token t+1."""
        chunks = ForwardChunks(self.engine, self.strategy, data, forward_batching(self.cfg, self.role.share_prompts))
        for b in chunks:
            values = self.engine(b["sequences"], host_tensor(b, "attention_mask"), prompt_lens=_prompt_lens(b))
            chunks.add(values[:, :-1])
        return chunks.result()

    def train(self, data: dict[str, torch.Tensor], global_step: int) -> dict[str, float]:
        cfg = self.cfg
        start = time.perf_counter()
        metrics = fit_experience(
            self.engine,
            data,
            critic_loss(self.engine, cfg.algo),
            batching=train_batching(cfg, self.role.share_prompts),
            rows_per_step=cfg.train.step_rows(self.role.rows_per_step, data["sequences"].size(0)),
            epochs=cfg.train.epochs("critic"),
            world_size=self.strategy.world_size,
            seed=cfg.train.seed + 1000 * global_step + 1,
            device=self.strategy.device,
            ring_size=self.role.ring,
            guard=self.guard,
        )
        return self.strategy.all_reduce_mean(self._perf("critic", metrics, data, time.perf_counter() - start))


class _FrozenWorker(BaseWorker):
    """A model that only runs forward passes (reference, reward): ZeRO-3 sharded and optionally offloaded."""

    def _build(self, cfg: PPOConfig, role: RolePlan, build: Callable[[torch.dtype], Any]) -> None:
        self.cfg, self.role = cfg, role
        self.strategy = make_strategy(cfg, role)
        self.strategy.setup_distributed()
        offload = cfg.model.ref_reward_offload
        with self.strategy.zero3_init(for_training=False, offload=offload):
            self.model = build(self.strategy.torch_dtype)
        _set_layout(cfg, role, self.model)
        self.engine = self.strategy.prepare_eval(self.model, offload=offload)


class ReferenceWorker(_FrozenWorker):
    def setup(self, cfg: PPOConfig, role: RolePlan) -> None:
        self._build(
            cfg,
            role,
            lambda dtype: Actor.from_pretrained(
                cfg.model.pretrain,
                dtype=dtype,
                attn_implementation=cfg.model.attn_implementation,
                **cfg.model.kernel_kwargs(),
            ),
        )

    log_probs = ActorWorker.log_probs


class TeacherWorker(_FrozenWorker):
    """A distillation teacher (--teacher_pretrain): the reference's forward on the teacher's weights (`role.model`)."""

    def setup(self, cfg: PPOConfig, role: RolePlan) -> None:
        self._build(
            cfg,
            role,
            lambda dtype: Actor.from_pretrained(
                role.model,
                dtype=dtype,
                attn_implementation=cfg.model.attn_implementation,
                **cfg.model.kernel_kwargs(),
            ),
        )

    log_probs = ActorWorker.log_probs


class RewardWorker(_FrozenWorker):
    def setup(self, cfg: PPOConfig, role: RolePlan) -> tuple[float, float]:
        """Returns the reward model's normalisation (mean, std) saved with it."""
        self._build(
            cfg,
            role,
            lambda dtype: ScalarModel.from_pretrained(
                cfg.model.reward_pretrain,
                dtype=dtype,
                flag="--reward_pretrain",
                attn_implementation=cfg.model.attn_implementation,
                **cfg.model.kernel_kwargs(),
            ),
        )
        return self.model.normalization()

    @torch.no_grad()
    def scores(self, data: dict[str, torch.Tensor]) -> torch.Tensor:
        """Raw reward-model score per sequence [B] (normalisation is applied with the reward shaping)."""
        chunks = ForwardChunks(self.engine, self.strategy, data, forward_batching(self.cfg, self.role.share_prompts))
        for b in chunks:
            last = last_token_index(b["attention_mask"]).unsqueeze(1)
            values = self.engine(b["sequences"], host_tensor(b, "attention_mask"), prompt_lens=_prompt_lens(b))
            chunks.add(values.gather(1, last).squeeze(1))
        return chunks.result()
