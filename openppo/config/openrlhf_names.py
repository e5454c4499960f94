"""OpenRLHF's flag names of both generations on openppo's typed config: the one table of other spellings.

Config fields carry the flat names of OpenRLHF <= 0.9 (`--colocate_all_models`, seed 004's recipes), so those need
no entry here. OpenRLHF >= 0.10 renamed every flag to a dotted form (`--train.colocate_all`); the `DOTTED_*` tables
map each to the field it sets, by the CLIs that declare it, and `--help` lists it beside the flat name. A value may
name several fields, the first one the CLI has (`--ref.offload` is `--ref_offload` in DPO and `--ref_reward_offload`
in PPO).

OpenRLHF >= 0.10 splits some settings per model (`--actor.max_norm`, `--critic.max_norm`) that openppo, like
OpenRLHF <= 0.9, keeps as one setting for both models: both dotted names map to the one field, and giving them
different values is an error rather than a silent choice of one.

`MOLT_*` do the same for the names of Molt, OpenRLHF's successor, where it renamed a setting openppo has.

`REFUSED` gives the reason for flags of either generation that a CLI does not run: a run that gives one stops
before anything starts, with that reason and what to do instead. `NO_EFFECT` holds flags that do nothing in a CLI
without the field (OpenRLHF 0.9 declared some and never read them); they are accepted, with one warning line.
"""

from __future__ import annotations

# OpenRLHF >= 0.10 dotted name -> openppo field (the flat OpenRLHF <= 0.9 name where there is one): every CLI
DOTTED_COMMON: dict[str, str | tuple[str, ...]] = {
    # ckpt.*
    "ckpt.disable_ds": "disable_ds_ckpt",
    "ckpt.load_enable": "load_checkpoint",
    "ckpt.max_mem": "max_ckpt_mem",
    "ckpt.max_num": "max_ckpt_num",
    "ckpt.output_dir": "save_path",
    "ckpt.path": "ckpt_path",
    "ckpt.save_hf": "save_hf_ckpt",
    "ckpt.save_steps": "save_steps",
    # data.*
    "data.apply_chat_template": "apply_chat_template",
    "data.dataloader_num_workers": "dataloader_num_workers",
    "data.disable_fast_tokenizer": "disable_fast_tokenizer",
    "data.input_key": "input_key",
    "data.input_template": "input_template",
    "data.max_len": "max_len",
    "data.max_samples": "max_samples",
    # ds.*
    "ds.adam_offload": "adam_offload",
    "ds.attn_implementation": "attn_implementation",
    "ds.deepcompile": "deepcompile",
    "ds.experts_implementation": "experts_implementation",
    "ds.grad_accum_dtype": "grad_accum_dtype",
    "ds.load_in_4bit": "load_in_4bit",
    "ds.lora.alpha": "lora_alpha",
    "ds.lora.dropout": "lora_dropout",
    "ds.lora.rank": "lora_rank",
    "ds.lora.target_modules": "target_modules",
    "ds.overlap_comm": "overlap_comm",
    "ds.packing_samples": "packing_samples",
    "ds.param_dtype": "param_dtype",
    "ds.ring_attn_head_stride": "ring_head_stride",
    "ds.ring_attn_size": "ring_attn_size",
    "ds.tensor_parallel_size": "ds_tensor_parallel_size",
    "ds.use_liger_kernel": "use_liger_kernel",
    "ds.use_universal_ckpt": "use_ds_universal_ckpt",
    "ds.value_head_prefix": "value_head_prefix",
    "ds.zero_stage": "zero_stage",
    "ds.zpg": "zpg",
    # eval.*
    "eval.dataset": "eval_dataset",
    "eval.split": "eval_split",
    "eval.steps": "eval_steps",
    # logger.*
    "logger.logging_steps": "logging_steps",
    "logger.tensorboard_dir": "use_tensorboard",
    "logger.wandb.group": "wandb_group",
    "logger.wandb.key": "use_wandb",
    "logger.wandb.org": "wandb_org",
    "logger.wandb.project": "wandb_project",
    "logger.wandb.run_name": "wandb_run_name",
    # ref.*
    "ref.offload": ("ref_offload", "ref_reward_offload"),
    # reward.*
    "reward.model_name_or_path": "reward_pretrain",
    "reward.normalize_enable": "normalize_reward",
    # train.*
    "train.batch_size": "train_batch_size",
    "train.full_determinism_enable": "full_determinism",
    "train.max_epochs": "max_epochs",
    "train.micro_batch_size": "micro_train_batch_size",
    "train.seed": "seed",
}

# train_ppo_ray only
DOTTED_RL: dict[str, str | tuple[str, ...]] = {
    # actor.*
    "actor.adam.betas": "adam_betas",
    "actor.adam.eps": "adam_eps",
    "actor.adam.lr": "actor_learning_rate",
    "actor.adam.weight_decay": "l2",
    "actor.aux_loss_coef": "aux_loss_coef",
    "actor.dual_clip": "dual_clip",
    "actor.entropy_coef": "entropy_loss_coef",
    "actor.eps_clip": "eps_clip",
    "actor.eps_clip_low_high": "eps_clip_low_high",
    "actor.freeze_visual_encoder": "freeze_visual_encoder",
    "actor.gradient_checkpointing_enable": "gradient_checkpointing",
    "actor.gradient_checkpointing_reentrant": "gradient_checkpointing_use_reentrant",
    "actor.lr_scheduler": "lr_scheduler",
    "actor.lr_warmup_ratio": "lr_warmup_ratio",
    "actor.max_norm": "max_norm",
    "actor.min_lr_ratio": "min_lr_ratio",
    "actor.model_name_or_path": "pretrain",
    "actor.muon.lr": "muon_lr",
    "actor.muon.momentum": "muon_momentum",
    "actor.muon.nesterov": "muon_nesterov",
    "actor.muon.no_nesterov": "muon_no_nesterov",
    "actor.muon.ns_steps": "muon_ns_steps",
    "actor.num_gpus_per_node": "actor_num_gpus_per_node",
    "actor.num_nodes": "actor_num_nodes",
    "actor.optim": "optim",
    "actor.policy_loss_type": "policy_loss_type",
    # algo.*
    "algo.advantage.estimator": "advantage_estimator",
    "algo.advantage.gamma": "gamma",
    "algo.advantage.is_correction_enable": "enable_vllm_is_correction",
    "algo.advantage.is_correction_threshold": "vllm_is_truncated_threshold",
    "algo.advantage.is_correction_type": "vllm_is_correction_type",
    "algo.advantage.lambd": "lambd",
    "algo.advantage.no_std_norm": "no_advantage_std_norm",
    "algo.dynamic_filtering_enable": "dynamic_filtering",
    "algo.dynamic_filtering_range": "dynamic_filtering_reward_range",
    "algo.kl.estimator": "kl_estimator",
    "algo.kl.horizon": "kl_horizon",
    "algo.kl.init_coef": "init_kl_coef",
    "algo.kl.target": "kl_target",
    "algo.kl.use_loss": "use_kl_loss",
    "algo.kl.unbiased_gradient": "kl_unbiased_gradient",  # (OpenRLHF after v0.11.0: its PR #1309)
    # ckpt.*
    "ckpt.best_metric_key": "best_metric_key",
    # critic.*
    "critic.adam.betas": "adam_betas",
    "critic.adam.eps": "adam_eps",
    "critic.adam.lr": "critic_learning_rate",
    "critic.adam.weight_decay": "l2",
    "critic.freezing_steps": "freezing_actor_steps",
    "critic.lr_scheduler": "lr_scheduler",
    "critic.lr_warmup_ratio": "lr_warmup_ratio",
    "critic.max_norm": "max_norm",
    "critic.min_lr_ratio": "min_lr_ratio",
    "critic.model_name_or_path": "critic_pretrain",
    "critic.muon.lr": "muon_lr",
    "critic.muon.momentum": "muon_momentum",
    "critic.muon.nesterov": "muon_nesterov",
    "critic.muon.no_nesterov": "muon_no_nesterov",
    "critic.muon.ns_steps": "muon_ns_steps",
    "critic.num_gpus_per_node": "critic_num_gpus_per_node",
    "critic.num_nodes": "critic_num_nodes",
    "critic.optim": "optim",
    "critic.save_value_network": "save_value_network",
    "critic.value_clip": "value_clip",
    # data.*
    "data.image_key": "image_key",
    "data.label_key": "label_key",
    "data.max_images_per_prompt": "max_images_per_prompt",
    "data.prompt_dataset": "prompt_data",
    "data.prompt_probs": "prompt_data_probs",
    "data.prompt_split": "prompt_split",
    # ds.*
    "ds.enable_sleep": "deepspeed_enable_sleep",
    # eval.*
    "eval.n_samples_per_prompt": "eval_n_samples_per_prompt",
    "eval.temperature": "eval_temperature",
    # ref.*
    "ref.num_gpus_per_node": "ref_num_gpus_per_node",
    "ref.num_nodes": "ref_num_nodes",
    # reward.*
    "reward.clip_range": "reward_clip_range",
    "reward.num_gpus_per_node": "reward_num_gpus_per_node",
    "reward.num_nodes": "reward_num_nodes",
    "reward.offload": "ref_reward_offload",
    "reward.overlong_buffer_len": "overlong_buffer_len",
    "reward.overlong_penalty_factor": "overlong_penalty_factor",
    "reward.remote_url": "remote_rm_url",
    "reward.stop_properly_penalty_coef": "stop_properly_penalty_coef",
    # rollout.*
    "rollout.batch_size": "rollout_batch_size",
    "rollout.max_new_tokens": "generate_max_len",
    "rollout.max_tokens_per_gpu": "rollout_max_tokens_per_gpu",
    "rollout.micro_batch_size": "micro_rollout_batch_size",
    "rollout.n_samples_per_prompt": "n_samples_per_prompt",
    "rollout.temperature": "temperature",
    "rollout.top_p": "top_p",
    "rollout.vllm_generate_batch_size": "vllm_generate_batch_size",
    # train.*
    "train.agent_func_path": "agent_func_path",
    "train.async_enable": "async_train",
    "train.async_queue_size": "async_queue_size",
    "train.colocate_actor_ref": "colocate_actor_ref",
    "train.colocate_all": "colocate_all_models",
    "train.colocate_critic_reward": "colocate_critic_reward",
    "train.dynamic_batch_enable": "use_dynamic_batch",
    "train.ema_beta": "ema_beta",
    "train.enable_ema": "enable_ema",
    "train.max_tokens_per_gpu": "train_max_tokens_per_gpu",
    "train.num_episodes": "num_episodes",
    "train.partial_rollout_enable": "partial_rollout",
    # vllm.*
    "vllm.enable_prefix_caching": "enable_prefix_caching",
    "vllm.enable_sleep": "vllm_enable_sleep",
    "vllm.enforce_eager": "enforce_eager",
    "vllm.gpu_memory_utilization": "vllm_gpu_memory_utilization",
    "vllm.num_engines": "vllm_num_engines",
    "vllm.sync_backend": "vllm_sync_backend",
    "vllm.sync_with_ray": "vllm_sync_with_ray",
    "vllm.tensor_parallel_size": "vllm_tensor_parallel_size",
}

# train_sft, train_rm, train_dpo and serve_rm only
DOTTED_SUPERVISED: dict[str, str | tuple[str, ...]] = {
    # adam.*
    "adam.betas": "adam_betas",
    "adam.eps": "adam_eps",
    "adam.lr": "learning_rate",
    "adam.weight_decay": "l2",
    # data.*
    "data.chosen_key": "chosen_key",
    "data.dataset": "dataset",
    "data.dataset_probs": "dataset_probs",
    "data.dataset_split": "dataset_split",
    "data.multiturn": "multiturn",
    "data.output_key": "output_key",
    "data.prompt_key": "prompt_key",
    "data.rejected_key": "rejected_key",
    "data.tokenizer_chat_template": "tokenizer_chat_template",
    # model.*
    "model.aux_loss_coef": "aux_loss_coef",
    "model.beta": "beta",
    "model.compute_fp32_loss_enable": "compute_fp32_loss",
    "model.gradient_checkpointing_enable": "gradient_checkpointing",
    "model.gradient_checkpointing_reentrant": "gradient_checkpointing_use_reentrant",
    "model.ipo_enable": "ipo",
    "model.label_smoothing": "label_smoothing",
    "model.loss_type": "loss",
    "model.margin_loss_enable": "margin_loss",
    "model.model_name_or_path": "pretrain",
    "model.nll_loss_coef": "nll_loss_coef",
    "model.pretrain_mode_enable": "pretrain_mode",
    # muon.*
    "muon.lr": "muon_lr",
    "muon.momentum": "muon_momentum",
    "muon.nesterov": "muon_nesterov",
    "muon.no_nesterov": "muon_no_nesterov",
    "muon.ns_steps": "muon_ns_steps",
    # ref.*
    "ref.model_name_or_path": "ref_pretrain",
}

# Molt (NVIDIA-NeMo/labs-molt, OpenRLHF's successor) keeps the dotted names and adds its own; these are its names for
# settings openppo has under another name, with the same meaning (tests/unit/test_molt_flags.py). Its FSDP2 names:
# context parallelism is openppo's ring, tensor parallelism its AutoTP.
MOLT_COMMON: dict[str, str | tuple[str, ...]] = {
    "ckpt.dcp_max_num": "max_resumable_ckpt_num",  # DCP: FSDP2's resumable checkpoints
    "ckpt.disable_final_save": "disable_final_save",
    "data.train_on_last_turn_only": "train_on_last_turn_only",  # train_sft
    "fsdp.attn_implementation": "attn_implementation",  # (its te and tilelang kernels are invalid choices here)
    "fsdp.cp_size": "ring_attn_size",
    "fsdp.packing_samples": "packing_samples",
    "fsdp.param_dtype": "param_dtype",
    "fsdp.tp_size": "ds_tensor_parallel_size",
    "muon.weight_decay": "muon_weight_decay",  # train_sft
    "data.image_key": "image_key",  # train_sft's image samples (train_ppo_ray's are OpenRLHF's names too)
    "data.max_images_per_prompt": "max_images_per_prompt",
    "model.freeze_visual_encoder": "freeze_visual_encoder",  # train_sft
}
# Molt's train_rl_ray only
MOLT_RL: dict[str, str | tuple[str, ...]] = {
    "actor.freezing_steps": "freezing_actor_steps",  # OpenRLHF's critic.freezing_steps: the actor waits N steps
    "actor.freeze_moe_router": "freeze_moe_router",  # one setting for actor and critic in openppo
    "critic.freeze_moe_router": "freeze_moe_router",
    "actor.muon.weight_decay": "muon_weight_decay",  # one optimizer setting for actor and critic in openppo
    "critic.muon.weight_decay": "muon_weight_decay",
    "actor.loss_mode": "policy_loss_type",  # ppo | gspo | cispo (cispo's ceiling: `schema._molt_cispo_ceiling`)
    "algo.advantage.lam": "lambd",
    "algo.advantage.no_whiten": "no_advantage_whiten",
    "critic.max_epochs": "critic_max_epochs",
    "eval.eval_at_start": "eval_at_start",
    "eval.eval_only": "eval_only",  # (engines only, as Molt, but for a checkpoint: docs/flags.md)
    "train.force_on_policy": "force_on_policy",
    "train.force_sync_mode": "force_sync_mode",
    "train.rollout_dump_dir": "rollout_dump_dir",
    "train.rollout_replay_dir": "rollout_replay_dir",
    "train.agent_path": "agent_func_path",  # a Molt agent file (AgentRunner(StepEnvRunner)): openppo/agents/molt.py
    "data.tools_key": "tools_key",
    "eval.batch_size": "eval_batch_size",
    "eval.max_new_tokens": "eval_max_new_tokens",
    "eval.top_p": "eval_top_p",
    "train.colocate_fsdp_models": "colocate_actor_ref",  # the critic too in Molt: docs/openrlhf-migration.md
    "train.check_weight_update_equal": "vllm_sync_check",
    # vLLM engine settings passed through (docs/flags.md)
    "vllm.dtype": "vllm_dtype",
    "vllm.block_size": "vllm_block_size",
    "vllm.max_num_batched_tokens": "vllm_max_num_batched_tokens",
    "vllm.enable_chunked_prefill": "vllm_enable_chunked_prefill",
    "vllm.async_scheduling": "vllm_async_scheduling",
    "vllm.attention_backend": "vllm_attention_backend",
    "vllm.mm_encoder_attn_backend": "vllm_mm_encoder_attn_backend",
    "vllm.gdn_prefill_backend": "vllm_gdn_prefill_backend",
    "vllm.mamba_ssm_cache_dtype": "vllm_mamba_ssm_cache_dtype",
    "vllm.disable_custom_all_reduce": "vllm_disable_custom_all_reduce",
}

# Molt's names for values openppo spells otherwise: field -> {Molt's value: openppo's}. Molt's grpo is
# (r - mean) / (std + 1e-9) per group with the unbiased std: group_norm's formula (whose eps is 1e-6).
# Molt's on_policy_distill is a distillation run (`schema._molt_distill` moves its teacher to --teacher_pretrain); the
# estimator then only shapes a task reward, which distillation alone has not.
MOLT_DISTILL = "on_policy_distill"
MOLT_VALUES: dict[str, dict[str, str]] = {"advantage_estimator": {"grpo": "group_norm", MOLT_DISTILL: "group_norm"}}
MOLT_REF = "ref.model_name_or_path"  # Molt's reference model, and its teacher with on_policy_distill

# Molt's FSDP2-only parallelism, which openppo's DeepSpeed engines do not have: name -> (the value that asks for
# nothing, accepted with one line; None for a switch, refused whenever given), the reason and the nearest setting
MOLT_FSDP_ONLY: dict[str, tuple[str | None, str]] = {
    "fsdp.ep_size": (
        "1",
        "expert parallelism is FSDP2's; openppo's ranks each hold every expert, sharded with the rest of the model "
        "by ZeRO-3 (--zero_stage 3)",
    ),
    "fsdp.pp_size": (
        "1",
        "openppo's DeepSpeed engines have no pipeline parallelism; shard the model with --zero_stage 3, or its "
        "layers' weights with --ds_tensor_parallel_size (Molt's --fsdp.tp_size)",
    ),
    "fsdp.sequence_parallel": (
        None,
        "sequence parallelism inside a tensor-parallel group is FSDP2's; openppo splits long rows over ranks "
        "with the ring (--ring_attn_size, Molt's --fsdp.cp_size)",
    ),
}

# The same for Molt's vLLM engine and rollout settings that openppo has no counterpart for (train_rl_ray only)
MOLT_RL_ONLY: dict[str, tuple[str | None, str]] = {
    "vllm.pipeline_parallel_size": (
        "1",
        "openppo's engines split a model over devices with tensor parallelism only (--vllm_tensor_parallel_size)",
    ),
    "vllm.data_parallel_size": (
        "1",
        "openppo runs data-parallel generation as separate engines: raise --vllm_num_engines",
    ),
    "vllm.decode_context_parallel_size": (
        "1",
        "openppo's engines keep each request's KV cache on its engine's tensor-parallel workers; use "
        "--vllm_tensor_parallel_size or more engines for long contexts",
    ),
    "vllm.mtp_num_speculative_tokens": (
        "0",
        "openppo's engines generate without speculative decoding (every token's log-prob comes from the policy's "
        "own forward); drop it",
    ),
    "vllm.enable_expert_parallel": (
        None,
        "openppo's engines split MoE experts with tensor parallelism like every other layer "
        "(--vllm_tensor_parallel_size); vLLM's expert parallelism is not wired in",
    ),
}

# Molt's settings of its own machinery, accepted in train_rl_ray with one line (takes a value, why it does nothing)
MOLT_RL_NO_EFFECT: dict[str, tuple[bool, str]] = {
    "vllm.distributed_executor_backend": (
        True,
        "openppo chooses each engine's executor from its placement (ray across a placement group's devices, "
        "else vLLM's own processes)",
    ),
    "vllm.router_policy": (
        True,
        "openppo's engine pool sends requests itself (a prompt's samples to one engine), with no vllm-router",
    ),
    "rollout.num_runners": (
        True,
        "openppo's rollouts and rewards run in the driver's engine pool and reward workers, with no runner actors",
    ),
    "ckpt.warm_resume_rollouts": (
        False,
        "a resumed --async_train run generates the batches the checkpoint had not trained on again, from its data "
        "position, with the resumed weights; none is saved",
    ),
}

# Molt's activation-checkpointing modes (full | selective | none), a string flag for openppo's one switch; per CLI
MOLT_CHECKPOINT_MODES: dict[str, str] = {
    "train_ppo_ray": "actor.gradient_checkpoint",
    "train_sft": "model.gradient_checkpoint",
}

# Molt's IS correction as two flags, level x mode: each pair Molt accepts is one --vllm_is_correction_type of the same
# formula (`openppo.algorithms.importance_weights`); the levels seq and geo drop whole responses, with mask their only
# mode there; "off" leaves the correction as openppo's own flags set it
MOLT_IS_LEVEL = "algo.advantage.is_correction_level"
MOLT_IS_MODE = "algo.advantage.is_correction_mode"
MOLT_IS_CORRECTION: dict[tuple[str, str], str] = {
    ("token", "clip"): "tis",
    ("token", "mask"): "icepop",
    ("token", "trunc"): "token-trunc",
    ("seq", "mask"): "seq-mask",
    ("geo", "mask"): "geo-mask",
}


def molt_only(name: str) -> bool:
    """Whether the option `name` (no dashes) is one of Molt's own, which no OpenRLHF generation has (Molt's SFT
    image names are OpenRLHF's RL ones)."""
    if name in DOTTED_COMMON or name in DOTTED_RL or name in DOTTED_SUPERVISED:
        return False
    return (
        name.startswith(("fsdp.", "no-fsdp."))
        or name in MOLT_COMMON
        or name in MOLT_RL
        or name in MOLT_RL_ONLY
        or name in MOLT_RL_NO_EFFECT
        or name in MOLT_CHECKPOINT_MODES.values()
        or name in (MOLT_IS_LEVEL, MOLT_IS_MODE)
    )


# other flat spellings of a field (OpenRLHF 0.9's generation limit)
OLDER: dict[str, str] = {"max_new_tokens": "generate_max_len"}


# flat field name (or dotted-only name) -> why a CLI without that field stops, and what to do instead
REFUSED: dict[str, str] = {
    "load_in_4bit": "4-bit loading needs bitsandbytes on CUDA, which openppo does not use; drop it, or train LoRA "
    "(--lora_rank) on the full-precision model",
    "use_ms": "openppo loads models from local folders (or the Hugging Face hub where reachable), not ModelScope; "
    "download the model and pass its folder",
    "deepcompile": "DeepSpeed's deepcompile needs CUDA; drop it",
    "muon_no_nesterov": "DeepSpeed's Muon, which --optim muon runs, always applies Nesterov momentum; drop it",
    "experts_implementation": "openppo loads MoE models with transformers' default expert kernels; drop it",
    # Molt's names
    "train.routing_replay": "openppo does not replay MoE routing: vLLM 0.32 returns the routed experts from its "
    "Model Runner V2 only, which on CPU needs a Triton with a CPU backend that no PyPI Triton has "
    "(tests/rollout/test_routed_experts.py), so no CPU test could run the replay; hold routing alike with "
    "--freeze_moe_router and weigh the mismatch with --enable_vllm_is_correction",
}

# flags that do nothing in a CLI without the field: (takes a value, why it is ignored)
NO_EFFECT: dict[str, tuple[bool, str]] = {
    "perf": (False, "OpenRLHF 0.9 declared it but never read it (removed in 0.10)"),
    "ptx_coef": (True, "OpenRLHF 0.9 declared it but never read it (removed in 0.10); there is no pretraining loss"),
    "actor_init_on_gpu": (False, "OpenRLHF 0.9 declared it but never read it (removed in 0.10)"),
    "dataloader_num_workers": (
        True,
        "train_ppo_ray tokenizes the prompts once in the driver and uses no data loader (the supervised CLIs do)",
    ),
    "train_split": (True, "OpenRLHF 0.9 declared it but read --dataset_split (removed in 0.10); use --dataset_split"),
    "muon_nesterov": (False, "DeepSpeed's Muon, which --optim muon runs, always applies Nesterov momentum"),
}


class Spellings:
    """The option names one CLI accepts besides its fields' flat names, and the ones it refuses.

    `cli` names the OpenRLHF CLI whose dotted names apply ("train_ppo_ray", "train_sft", ...); None: flat names only.
    """

    def __init__(self, fields: set[str], cli: str | None):
        self.fields = fields
        self.dotted: dict[str, str | tuple[str, ...]] = {}
        if cli is not None:
            rl = cli == "train_ppo_ray"
            self.dotted = {**DOTTED_COMMON, **(DOTTED_RL if rl else DOTTED_SUPERVISED), **MOLT_COMMON}
            if rl:
                self.dotted.update(MOLT_RL)

    def _targets(self, name: str) -> tuple[str, ...]:
        target = self.dotted.get(name) or OLDER.get(name) or name
        return (target,) if isinstance(target, str) else target

    def field_of(self, name: str) -> str | None:
        """The field the option `name` (no dashes, either generation) sets, or None."""
        if name in self.fields:
            return name
        return next((t for t in self._targets(name) if t in self.fields), None)

    def aliases(self) -> dict[str, list[str]]:
        """Per field, its other spellings."""
        out: dict[str, list[str]] = {}
        for name in (*self.dotted, *OLDER):
            field = self.field_of(name)
            if field is not None:
                out.setdefault(field, []).append(name)
        return out

    def refusal(self, name: str) -> str | None:
        """Why this CLI stops at the option `name` it has no field for, or None (unknown, or known)."""
        if self.field_of(name) is not None:
            return None
        return next((REFUSED[t] for t in self._targets(name) if t in REFUSED), None)
