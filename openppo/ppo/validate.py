"""Up-front checks of a PPOConfig: contradictions name both flags, no-ops on this hardware are said once.

`validate(cfg, on_gpu)` raises `UserError` for anything that cannot work and returns the notices (one line each)
for options that are accepted but cannot take effect here. It never rewrites the config. It is two halves:
`validate_flags` needs no device (train_ppo_ray runs it before Ray starts), `validate_devices` takes the devices the
cluster offers (`on_gpu`), which may not be the driver's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from openppo.algorithms import GROUP_ESTIMATORS, needs_critic, whitens_by_default
from openppo.config.common import validate_build, validate_outputs, validate_schedule
from openppo.errors import UserError, require
from openppo.models.hf import aux_loss_notice, is_mixture_of_experts, kv_heads, resolve_model_path
from openppo.models.kernels import check_compile, liger_notice
from openppo.ppo.config import PPOConfig, engines_colocated, ranks_per_shard
from openppo.ppo.teachers import check_teacher_tokenizers, parse_teachers
from openppo.strategy.config import ds_notices, state_offload_supported, validate_ds_settings
from openppo.strategy.deepspeed_strategy import validate_precision
from openppo.utils.profiling import parse_profile_steps

# (config section, field) of the settings that only a critic (--advantage_estimator gae) reads
_CRITIC_ONLY = (
    ("algo", "lambd"),
    ("algo", "value_clip"),
    ("train", "critic_learning_rate"),
    ("train", "freezing_actor_steps"),
    ("train", "critic_max_epochs"),
)


def needs_reference(cfg: PPOConfig) -> bool:
    return cfg.algo.init_kl_coef > 0


def needs_critic_group(cfg: PPOConfig) -> bool:
    return needs_critic(cfg.algo.advantage_estimator)


def actor_world_size(cfg: PPOConfig) -> int:
    return role_ranks(cfg, "actor")


def used_roles(cfg: PPOConfig) -> list[str]:
    """The model roles this run starts: the actor, and the reference, critic and reward model where needed."""
    used = {
        "actor": True,
        "ref": needs_reference(cfg),
        "critic": needs_critic_group(cfg),
        "reward": bool(cfg.model.reward_pretrain),
        "teacher": bool(cfg.model.teacher_pretrain),
    }
    return [role for role, present in used.items() if present]


def role_ranks(cfg: PPOConfig, role: str) -> int:
    """The ranks of a role's worker group: --<role>_num_nodes x --<role>_num_gpus_per_node."""
    return getattr(cfg.resources, f"{role}_num_nodes") * getattr(cfg.resources, f"{role}_num_gpus_per_node")


def _positive(value, flag: str) -> None:
    require(value is not None and value > 0, f"{flag} must be positive, got {value}")


def _models(cfg: PPOConfig) -> None:
    m, algo = cfg.model, cfg.algo
    resolve_model_path(m.pretrain, "--pretrain")
    if cfg.vllm.vllm_sync_check and is_mixture_of_experts(m.pretrain):
        raise UserError(
            "--vllm_sync_check reads back dense layers only, not vLLM's fused expert layers of a mixture-of-experts "
            "--pretrain: drop it (rollout/logprob_diff still shows a bad sync)"
        )
    require(m.remote_rm_timeout > 0, f"--remote_rm_timeout must be positive (seconds), got {m.remote_rm_timeout}")
    require(m.reward_func_timeout > 0, f"--reward_func_timeout must be positive (seconds), got {m.reward_func_timeout}")
    require(m.remote_rm_retries >= 0, f"--remote_rm_retries must be >= 0, got {m.remote_rm_retries}")
    if m.reward_pretrain and m.remote_rm_url:
        raise UserError("--reward_pretrain and --remote_rm_url both given: pick one reward source")
    agent = cfg.rollout.agent_func_path
    if agent and (m.reward_pretrain or m.remote_rm_url):
        raise UserError(
            f"--agent_func_path {agent}: the agent's environment gives the reward; drop "
            f"{'--reward_pretrain' if m.reward_pretrain else '--remote_rm_url'}"
        )
    teachers = parse_teachers(m.teacher_pretrain)
    # an --agent_program returns its rewards (or leaves them to a reward source: served_agents.py)
    rewarded = bool(agent or m.reward_pretrain or m.remote_rm_url or cfg.rollout.agent_program)
    if not rewarded and not teachers:
        raise UserError(
            "a reward source is required: --reward_pretrain DIR, --remote_rm_url URL[,URL] / FILE.py, "
            "--agent_func_path FILE.py or --agent_program SPEC (or a teacher to distill from: --teacher_pretrain DIR)"
        )
    if teachers and algo.distill_task_coef and not rewarded:
        raise UserError(
            f"--distill_task_coef {algo.distill_task_coef} weighs the task reward's advantage, and the run has no "
            f"reward source: add --remote_rm_url / --reward_pretrain / --agent_func_path, or set --distill_task_coef 0"
        )
    if teachers and not rewarded and cfg.rollout.dynamic_filtering:
        raise UserError(
            "--dynamic_filtering drops groups whose rewards are all equal, and distillation without a reward source "
            "gives every sample 0: drop --dynamic_filtering or add a reward source"
        )
    for t in teachers:
        resolve_model_path(t.path, f"--teacher_pretrain {t.name}")
    if teachers:
        check_teacher_tokenizers(m.pretrain, teachers)
    if m.reward_pretrain:
        resolve_model_path(m.reward_pretrain, "--reward_pretrain")
    if m.critic_pretrain:
        if algo.advantage_estimator != "gae":
            raise UserError(
                f"--critic_pretrain is only used by --advantage_estimator gae, not "
                f"{algo.advantage_estimator}: drop one of them"
            )
        resolve_model_path(m.critic_pretrain, "--critic_pretrain")
    validate_build(m)
    t = cfg.train
    require(0 <= t.ema_beta <= 1, f"--ema_beta must be in [0, 1], got {t.ema_beta}")
    if t.enable_ema and m.lora_rank > 0:
        raise UserError(
            "--enable_ema averages the full weights, which a LoRA export (the adapter alone) cannot hold: drop "
            "--enable_ema or --lora_rank"
        )


def _algorithm(cfg: PPOConfig) -> None:
    algo, r = cfg.algo, cfg.rollout
    if algo.advantage_estimator in GROUP_ESTIMATORS and r.n_samples_per_prompt < 2:
        raise UserError(
            f"--advantage_estimator {algo.advantage_estimator} needs a group: set "
            f"--n_samples_per_prompt >= 2 (got {r.n_samples_per_prompt})"
        )
    if r.dynamic_filtering and r.n_samples_per_prompt < 2:
        raise UserError("--dynamic_filtering needs --n_samples_per_prompt >= 2 (it filters groups)")
    require(
        algo.use_kl_loss or not algo.kl_unbiased_gradient,
        "--kl_unbiased_gradient sets the KL loss's gradient: add --use_kl_loss (a KL reward penalty is detached), "
        "or drop it",
    )
    require(algo.init_kl_coef >= 0, f"--init_kl_coef must be >= 0, got {algo.init_kl_coef}")
    if algo.kl_target is not None:
        _positive(algo.kl_target, "--kl_target")
        _positive(algo.kl_horizon, "--kl_horizon")
        require(algo.init_kl_coef > 0, "--kl_target adapts the KL coefficient: set --init_kl_coef > 0")
    # the RL math's option rules: the math itself only asserts them, without flag names (algorithms/reductions.py)
    if algo.eps_clip_low_high is None:
        require(
            0 < algo.eps_clip < 1,
            f"--eps_clip: must be in (0, 1) (the ratio is clipped to [1 - eps, 1 + eps]), got {algo.eps_clip}; "
            f"0.2 is usual",
        )
    else:
        low, high = algo.eps_clip_low_high
        require(0 < low < 1 and high > 0, f"--eps_clip_low_high: need 0 < low < 1 and high > 0, got {low} {high}")
    require(algo.dual_clip is None or algo.dual_clip > 1, f"--dual_clip: must be > 1 (e.g. 3), got {algo.dual_clip}")
    require(
        algo.dual_clip is None or algo.policy_loss_type != "cispo",
        "--dual_clip: it bounds PPO's clipped loss, and --policy_loss_type cispo has none (it clips the IS weight); "
        "drop --dual_clip",
    )
    require(algo.value_clip is None or algo.value_clip > 0, f"--value_clip: must be > 0, got {algo.value_clip}")
    low, high = cfg.vllm.vllm_is_truncated_threshold
    require(0 <= low < high, f"--vllm_is_truncated_threshold: need 0 <= low < high, got {low} {high}")
    require(0 < algo.gamma <= 1, f"--gamma must be in (0, 1], got {algo.gamma}")
    require(0 <= algo.lambd <= 1, f"--lambd must be in [0, 1], got {algo.lambd}")
    if algo.advantage_estimator in GROUP_ESTIMATORS and algo.gamma != 1.0:
        raise UserError(
            f"--gamma {algo.gamma} with --advantage_estimator {algo.advantage_estimator}: group "
            f"estimators score whole responses; use --gamma 1"
        )
    low, high = algo.reward_clip_range
    require(low < high, f"--reward_clip_range: low must be < high, got {low} {high}")
    require(
        algo.entropy_loss_coef is None or algo.entropy_loss_coef >= 0,
        f"--entropy_loss_coef must be >= 0, got {algo.entropy_loss_coef}",
    )
    if algo.overlong_buffer_len is not None:
        limit, buffer = cfg.data.generate_max_len, algo.overlong_buffer_len
        require(0 < buffer <= limit, f"--overlong_buffer_len: must be in (0, --generate_max_len={limit}], got {buffer}")
        factor = algo.overlong_penalty_factor
        require(factor >= 0, f"--overlong_penalty_factor: must be >= 0, got {factor}")
    coef = algo.stop_properly_penalty_coef
    require(
        coef is None or coef <= 1,
        f"--stop_properly_penalty_coef: must be <= 1 (a factor in [0, 1] or a negative fixed reward), got {coef}",
    )
    lo, hi = r.dynamic_filtering_reward_range
    require(lo < hi, f"--dynamic_filtering_reward_range needs low < high, got {lo} {hi}")


def _batches(cfg: PPOConfig) -> None:
    r, t, d = cfg.rollout, cfg.train, cfg.data
    for value, flag in (
        (r.rollout_batch_size, "--rollout_batch_size"),
        (r.n_samples_per_prompt, "--n_samples_per_prompt"),
        (r.micro_rollout_batch_size, "--micro_rollout_batch_size"),
        (t.train_batch_size, "--train_batch_size"),
        (t.micro_train_batch_size, "--micro_train_batch_size"),
        (t.max_epochs, "--max_epochs"),
        (t.epochs("critic"), "--critic_max_epochs"),
        (t.num_episodes, "--num_episodes"),
        (d.prompt_max_len, "--prompt_max_len"),
        (d.generate_max_len, "--generate_max_len"),
        (2 if d.max_len is None else d.max_len - 1, "--max_len (room for one prompt and one response token)"),
        (r.temperature, "--temperature"),
        (cfg.vllm.vllm_num_engines, "--vllm_num_engines"),
    ):
        _positive(value, flag)
    require(r.top_k == -1 or r.top_k >= 1, f"--top_k: must be -1 (off) or >= 1, got {r.top_k}")
    require(0.0 < r.top_p <= 1.0, f"--top_p: must be in (0, 1], got {r.top_p}")
    samples = r.rollout_batch_size * r.n_samples_per_prompt
    if samples % t.train_batch_size:
        raise UserError(
            f"--rollout_batch_size x --n_samples_per_prompt = {samples} samples per step is not a "
            f"multiple of --train_batch_size {t.train_batch_size}; pick sizes so that it is"
        )
    # Forward-only passes deal the rollout batch over a role's ranks, unevenly if need be, but each rank needs a row.
    for role in used_roles(cfg):
        world = role_ranks(cfg, role) // max(ranks_per_shard(cfg, role), 1)
        if samples < world:
            raise UserError(
                f"{samples} samples per step cannot feed {world} data-parallel {role} ranks "
                f"(--{role}_num_nodes x --{role}_num_gpus_per_node): use fewer ranks or a larger "
                f"--rollout_batch_size"
            )
    trained = {"actor": True, "critic": needs_critic_group(cfg)}
    for role in (role for role, used in trained.items() if used):
        world = role_ranks(cfg, role) // max(ranks_per_shard(cfg, role), 1)
        if t.train_batch_size % (t.micro_train_batch_size * world):
            raise UserError(
                f"--train_batch_size {t.train_batch_size} is not a multiple of --micro_train_batch_size "
                f"{t.micro_train_batch_size} x {world} data-parallel {role} ranks (--{role}_num_nodes x "
                f"--{role}_num_gpus_per_node); pick a --train_batch_size that is"
            )
    require(
        not (r.force_sync_mode and r.async_train),
        "--force_sync_mode generates each batch with the weights that train on it, --async_train generates ahead "
        "with older ones: drop one",
    )
    require(
        not t.force_on_policy or t.max_epochs == 1,
        f"--force_on_policy trains one step on each batch, and --max_epochs {t.max_epochs} would step again on it: "
        "pass --max_epochs 1",
    )
    require(
        not (t.rollout_dump_dir and t.rollout_replay_dir),
        "--rollout_dump_dir and --rollout_replay_dir both given: a replaying run generates nothing to dump; drop one",
    )
    require(
        not d.eval_only or d.eval_dataset,
        "--eval_only evaluates on --eval_dataset: pass one (a prompt file or folder, as --prompt_data)",
    )
    if d.eval_dataset:
        _positive(d.eval_n_samples_per_prompt, "--eval_n_samples_per_prompt")
        _positive(d.eval_temperature, "--eval_temperature")
        for value, flag in ((d.eval_max_new_tokens, "--eval_max_new_tokens"), (d.eval_batch_size, "--eval_batch_size")):
            if value is not None:
                _positive(value, flag)
        require(d.eval_top_p is None or 0 < d.eval_top_p <= 1, f"--eval_top_p must be in (0, 1], got {d.eval_top_p}")
        own = [f for f, v in (("--eval_top_p", d.eval_top_p), ("--eval_max_new_tokens", d.eval_max_new_tokens)) if v]
        agent = cfg.rollout.agent_func_path or cfg.rollout.agent_program
        require(
            not (own and agent),
            f"{', '.join(own)}: an agent's turns are sampled as the rollout's (--top_p, --generate_max_len); drop "
            f"{'it' if len(own) == 1 else 'them'}",
        )
    require(cfg.logging.eval_steps != 0, "--eval_steps must be positive, or -1 for the end of each episode")
    require(cfg.rollout.agent_max_turns > 0, f"--agent_max_turns must be positive, got {cfg.rollout.agent_max_turns}")
    require(cfg.ckpt.save_steps != 0, "--save_steps must be positive, or -1 for only at the end")
    require(cfg.ckpt.max_ckpt_num > 0, f"--max_ckpt_num must be positive, got {cfg.ckpt.max_ckpt_num}")
    require(0.0 <= t.lr_warmup_ratio < 1.0, f"--lr_warmup_ratio must be in [0, 1), got {t.lr_warmup_ratio}")
    _positive(t.actor_learning_rate, "--actor_learning_rate")
    _positive(t.critic_learning_rate, "--critic_learning_rate")
    validate_schedule(min_lr_ratio=t.min_lr_ratio, max_norm=t.max_norm)
    _positive(cfg.logging.logging_steps, "--logging_steps")
    try:
        parse_profile_steps(cfg.logging.profile_steps)
    except ValueError:
        raise UserError(
            f"--profile_steps takes a comma list of positive step numbers (e.g. 2,5), got {cfg.logging.profile_steps!r}"
        ) from None
    if r.train_max_tokens_per_gpu is not None:
        _positive(r.train_max_tokens_per_gpu, "--train_max_tokens_per_gpu")
    if r.rollout_max_tokens_per_gpu is not None:
        _positive(r.rollout_max_tokens_per_gpu, "--rollout_max_tokens_per_gpu")


def _shared_prompts(cfg: PPOConfig) -> None:
    if cfg.rollout.share_prompt_in_group == "on" and not cfg.rollout.packing_samples:
        raise UserError(
            "--share_prompt_in_group packs each group's rows around one copy of its prompt: add --packing_samples"
        )
    if cfg.rollout.share_prompt_in_group == "on" and cfg.model.attn_implementation != "sdpa":
        raise UserError(
            f"--share_prompt_in_group on needs openppo's own attention over the shared row (per-response sdpa on "
            f"CPU, FlexAttention on GPU), which replaces sdpa only: drop --attn_implementation "
            f"{cfg.model.attn_implementation} or the sharing"
        )


def _sequence_parallel(cfg: PPOConfig) -> None:
    r = cfg.rollout
    _positive(r.ring_attn_size, "--ring_attn_size")
    require(
        r.ring_head_stride >= 0, f"--ring_head_stride must be >= 0 (0 = all KV heads at once), got {r.ring_head_stride}"
    )
    if r.ring_attn_size > 1 and r.share_prompt_in_group == "on":
        raise UserError(
            "--share_prompt_in_group with --ring_attn_size: a ring splits a row's tokens over ranks, and a shared "
            "prompt would have to reach every chunk of its responses; drop one of them"
        )
    if r.ring_attn_size == 1:
        return
    if cfg.model.aux_loss_coef > 0:
        raise UserError(
            "--aux_loss_coef with --ring_attn_size: each ring rank routes only its chunk of a row, so the "
            "load-balancing loss is not the row's; drop one of them"
        )
    if not r.packing_samples:
        raise UserError("--ring_attn_size shards packed rows over ranks: add --packing_samples")
    for role in used_roles(cfg):
        ranks = role_ranks(cfg, role)
        if ranks % r.ring_attn_size:
            raise UserError(
                f"--ring_attn_size {r.ring_attn_size} must divide the {role} ranks (--{role}_num_nodes x "
                f"--{role}_num_gpus_per_node = {ranks})"
            )
    m, stride = cfg.model, r.ring_head_stride
    models = {"--pretrain": m.pretrain, "--critic_pretrain": m.critic_pretrain, "--reward_pretrain": m.reward_pretrain}
    models.update({f"--teacher_pretrain {t.name}": t.path for t in parse_teachers(m.teacher_pretrain)})
    for flag, path in models.items() if stride else ():
        heads = kv_heads(path) if path else 0
        require(heads % stride == 0, f"--ring_head_stride {stride} must divide the KV heads of {flag} ({heads})")


def _tensor_parallel(cfg: PPOConfig) -> None:
    """--ds_tensor_parallel_size P: DeepSpeed AutoTP splits the actor's weights over P consecutive ranks."""
    tp, ds = cfg.ds.ds_tensor_parallel_size, cfg.ds
    _positive(tp, "--ds_tensor_parallel_size")
    if tp == 1:
        return
    ranks = actor_world_size(cfg)
    if ranks % tp:
        raise UserError(
            f"--ds_tensor_parallel_size {tp} must divide the actor ranks (--actor_num_nodes x "
            f"--actor_num_gpus_per_node = {ranks}); pick a divisor or add actor ranks"
        )
    if ds.zero_stage == 3:
        raise UserError(
            "--ds_tensor_parallel_size needs --zero_stage 0, 1 or 2 (DeepSpeed AutoTP does not combine "
            "with ZeRO-3's parameter sharding)"
        )
    if cfg.rollout.ring_attn_size > 1:
        raise UserError(
            "--ds_tensor_parallel_size and --ring_attn_size both split the actor's work over ranks: use one of them"
        )
    if cfg.model.lora_rank > 0:
        raise UserError(
            "--ds_tensor_parallel_size does not split LoRA adapters: drop --lora_rank or use "
            "--ds_tensor_parallel_size 1"
        )
    if ds.optim == "muon":
        raise UserError(
            "--ds_tensor_parallel_size with --optim muon: Muon orthogonalises each weight matrix whole, and AutoTP "
            "leaves each rank a slice of it; use --optim adam or --ds_tensor_parallel_size 1"
        )


def _resources(cfg: PPOConfig, notices: list[str]) -> None:
    res, v, ds = cfg.resources, cfg.vllm, cfg.ds
    for flag in ("actor", "critic", "ref", "reward", "teacher"):
        _positive(getattr(res, f"{flag}_num_nodes"), f"--{flag}_num_nodes")
        _positive(getattr(res, f"{flag}_num_gpus_per_node"), f"--{flag}_num_gpus_per_node")
    _positive(v.vllm_tensor_parallel_size, "--vllm_tensor_parallel_size")
    _positive(v.vllm_sync_bucket_mb, "--vllm_sync_bucket_mb")
    require(
        cfg.train.max_rank_restarts >= 0,
        f"--max_rank_restarts must be >= 0 (0 stops the run when a rank dies), got {cfg.train.max_rank_restarts}",
    )
    if cfg.train.max_rank_restarts and cfg.ckpt.save_steps <= 0:
        notices.append(
            "--max_rank_restarts without --save_steps: no checkpoint is committed, so a restart starts at step 0"
        )
    require(
        v.max_engine_restarts >= 0,
        f"--max_engine_restarts must be >= 0 (0 stops the run at the first dead engine), got {v.max_engine_restarts}",
    )
    if v.vllm_kv_cache_bytes is not None:
        _positive(v.vllm_kv_cache_bytes, "--vllm_kv_cache_bytes")
    if v.vllm_block_size is not None:
        _positive(v.vllm_block_size, "--vllm_block_size")
    if v.vllm_max_num_batched_tokens is not None:
        _positive(v.vllm_max_num_batched_tokens, "--vllm_max_num_batched_tokens")
        require(
            v.vllm_enable_chunked_prefill is not False or v.vllm_max_num_batched_tokens >= cfg.data.total_len(),
            f"--vllm_max_num_batched_tokens {v.vllm_max_num_batched_tokens} with --no-vllm_enable_chunked_prefill: "
            f"a whole prompt + response ({cfg.data.total_len()} tokens) must fit in one step; raise it or allow "
            "chunked prefill",
        )
    validate_ds_settings(ds)
    require(
        0 < v.vllm_gpu_memory_utilization <= 1,
        f"--vllm_gpu_memory_utilization must be in (0, 1], got {v.vllm_gpu_memory_utilization}",
    )
    if res.colocate_all_models:
        engines = v.vllm_num_engines * v.vllm_tensor_parallel_size
        if engines_colocated(cfg) and engines != actor_world_size(cfg):
            raise UserError(
                f"--colocate_all_models needs --vllm_num_engines x --vllm_tensor_parallel_size "
                f"({engines}) == actor ranks ({actor_world_size(cfg)}); set --vllm_num_engines to "
                f"the actor ranks or drop --colocate_all_models"
            )
        for role, used in (
            ("ref", needs_reference(cfg)),
            ("critic", needs_critic_group(cfg)),
            ("reward", bool(cfg.model.reward_pretrain)),
            ("teacher", bool(cfg.model.teacher_pretrain)),
        ):
            size = (getattr(res, f"{role}_num_nodes"), getattr(res, f"{role}_num_gpus_per_node"))
            if used and size != (res.actor_num_nodes, res.actor_num_gpus_per_node):
                raise UserError(
                    f"--colocate_all_models puts every model on the actor's devices: set "
                    f"--{role}_num_nodes/--{role}_num_gpus_per_node ({size[0]}/{size[1]}) to the actor's "
                    f"({res.actor_num_nodes}/{res.actor_num_gpus_per_node})"
                )
    if (
        res.colocate_actor_ref
        and needs_reference(cfg)
        and (res.ref_num_nodes, res.ref_num_gpus_per_node) != (res.actor_num_nodes, res.actor_num_gpus_per_node)
    ):
        raise UserError("--colocate_actor_ref needs --ref_num_nodes/--ref_num_gpus_per_node equal to the actor's")
    critic_size = (res.critic_num_nodes, res.critic_num_gpus_per_node)
    if (
        res.colocate_critic_reward
        and needs_critic_group(cfg)
        and cfg.model.reward_pretrain
        and critic_size != (res.reward_num_nodes, res.reward_num_gpus_per_node)
    ):
        raise UserError("--colocate_critic_reward needs --critic_num_* equal to --reward_num_*")
    if v.vllm_enable_sleep and not res.colocate_all_models:
        raise UserError(
            "--vllm_enable_sleep frees engine memory for colocated training: add "
            "--colocate_all_models or drop --vllm_enable_sleep"
        )
    if ds.deepspeed_enable_sleep and ds.adam_offload:
        raise UserError("--deepspeed_enable_sleep and --adam_offload both move optimizer states to CPU: pick one")
    if ds.deepspeed_enable_sleep and ds.zero_stage == 0:
        raise UserError("--deepspeed_enable_sleep offloads ZeRO optimizer states: set --zero_stage 1, 2 or 3")
    if res.colocate_actor_ref and not needs_reference(cfg):
        notices.append("--colocate_actor_ref: no reference model runs (--init_kl_coef 0), nothing to colocate")
    if res.colocate_critic_reward and not (needs_critic_group(cfg) and cfg.model.reward_pretrain):
        notices.append("--colocate_critic_reward: needs both a critic (gae) and --reward_pretrain; nothing to colocate")
    if cfg.rollout.async_train and v.vllm_enable_sleep:
        raise UserError("--async_train generates while training, so engines cannot sleep: drop --vllm_enable_sleep")
    if cfg.rollout.async_train and res.colocate_all_models:
        # the hybrid engine hands each device to the engines and the trainer in turn; async training keeps both busy
        notices.append(
            "--colocate_all_models with --async_train colocates the DeepSpeed models only (as OpenRLHF does): the "
            f"vLLM engines generate on {v.vllm_num_engines * v.vllm_tensor_parallel_size} device(s) of their own "
            "while the trainer works"
        )
    generate_batch = cfg.rollout.vllm_generate_batch_size
    if generate_batch is not None and generate_batch != cfg.rollout.rollout_batch_size:
        # OpenRLHF's rule: a synchronous step trains on the policy that generated it, so it takes no surplus
        require(
            cfg.rollout.async_train, "--vllm_generate_batch_size other than --rollout_batch_size needs --async_train"
        )
        require(
            generate_batch > cfg.rollout.rollout_batch_size,
            f"--vllm_generate_batch_size {generate_batch} is below --rollout_batch_size "
            f"{cfg.rollout.rollout_batch_size}: a round draws at least a batch; raise it or drop it",
        )
    if cfg.rollout.async_train:
        _positive(cfg.rollout.async_queue_size, "--async_queue_size")
        if not v.enable_vllm_is_correction:
            notices.append(
                f"--async_train: samples from older weights are importance-weighted "
                f"(--vllm_is_correction_type {v.vllm_is_correction_type})"
            )
    check_compile(
        cfg.model.torch_compile,
        use_liger_kernel=cfg.model.use_liger_kernel,
        zero_stage=ds.zero_stage,
        ring_attn_size=cfg.rollout.ring_attn_size,
        tensor_parallel_size=ds.ds_tensor_parallel_size,
    )
    if ds.deepcompile and ds.zero_stage == 0:
        notices.append("--deepcompile with --zero_stage 0: DeepSpeed falls back to plain torch.compile")
    if cfg.model.ref_reward_offload and ds.zero_stage != 3:
        notices.append(
            f"--ref_reward_offload has no effect with --zero_stage {ds.zero_stage}: the reference and "
            f"reward models' parameters are offloaded by ZeRO-3 only (use --zero_stage 3)"
        )


def validate_devices(cfg: PPOConfig, on_gpu: bool) -> list[str]:
    """The checks and notices that depend on the devices the run gets: the cluster's (`on_gpu`: its nodes have
    GPUs), not the driver's, which may be a GPU-less head node (`openppo.ppo.launch.cluster_devices`)."""
    v, ds = cfg.vllm, cfg.ds
    notices: list[str] = []
    if ds.deepspeed_enable_sleep and not state_offload_supported(ds.zero_stage, on_gpu):
        notices.append(
            "--deepspeed_enable_sleep with --zero_stage 3 on CPU: DeepSpeed offloads ZeRO-3 states only "
            "with its GPU FusedAdam, so the states stay put (use --zero_stage 2 to exercise the offload)"
        )
    if not on_gpu and ds.deepcompile:
        raise UserError("--deepcompile needs a GPU (DeepSpeed compiles CUDA graph passes): drop it on this machine")
    validate_precision(ds.param_dtype, on_gpu)
    notices.extend(ds_notices(ds, on_gpu))
    if (notice := liger_notice(cfg.model.use_liger_kernel, on_gpu)) is not None:
        notices.append(notice)
    if not on_gpu:
        notices.append(
            "no GPU: *_num_gpus_per_node count worker processes; vLLM runs eager (CUDA graphs and "
            "--enforce_eager do not apply); weight sync uses gloo (shared memory for engines colocated "
            "by --colocate_all_models)"
        )
        if v.vllm_enable_sleep:
            notices.append("--vllm_enable_sleep is a no-op on CPU (vLLM cannot sleep there)")
        notices.extend(
            f"--vllm_{name} has no effect on CPU: it chooses vLLM's GPU kernels" for name in v.gpu_engine_args()
        )
        require(
            v.vllm_block_size is None or v.vllm_block_size % 32 == 0,
            f"--vllm_block_size {v.vllm_block_size}: vLLM's CPU attention takes multiples of 32; pass 32 (the CPU "
            "default) or a multiple",
        )
        if v.vllm_sync_backend == "nccl":
            notices.append("--vllm_sync_backend nccl needs GPUs: gloo is used instead")
    return notices


# the row counts of the micro-batches, which a token budget replaces (--use_dynamic_batch)
_MICRO_ROWS = (("train", "micro_train_batch_size"), ("rollout", "micro_rollout_batch_size"))


def _set(section: Any, name: str) -> bool:
    """Whether the field `name` of a config section holds other than its default (the user set it)."""
    default = next(f.default for f in dataclasses.fields(section) if f.name == name)
    return getattr(section, name) != default


def _no_effect(cfg: PPOConfig, notices: list[str]) -> None:
    """Options that are accepted, and valid, but do nothing (or not what their name says) in this run."""
    algo, m = cfg.algo, cfg.model
    if not needs_critic_group(cfg):
        unused = [f"--{name}" for section, name in _CRITIC_ONLY if _set(getattr(cfg, section), name)]
        if unused:
            notices.append(
                f"{', '.join(unused)} {'has' if len(unused) == 1 else 'have'} no effect with --advantage_estimator "
                f"{algo.advantage_estimator}: only gae trains a critic"
            )
    whitened = [f for f in ("no_advantage_whiten", "no_advantage_std_norm") if getattr(algo, f)]
    if whitened and not whitens_by_default(algo.advantage_estimator):
        notices.append(
            f"--{whitened[0]} has no effect with --advantage_estimator {algo.advantage_estimator}: it normalises "
            "per group, never over the batch"
        )
    if algo.use_kl_loss and not needs_reference(cfg):
        # a no-op, not a contradiction: OpenRLHF's VLM recipe (0.11.0) gives both
        notices.append(
            "--use_kl_loss has no effect with --init_kl_coef 0: no reference model runs, so there is no KL to add"
        )
    if _set(algo, "kl_horizon") and algo.kl_target is None:
        notices.append("--kl_horizon has no effect without --kl_target: the KL coefficient stays --init_kl_coef")
    if cfg.rollout.force_sync_mode:
        notices.append("--force_sync_mode has no effect: without --async_train every batch is generated in sync")
    if cfg.rollout.use_dynamic_batch:
        # (OpenRLHF's recipes give the row counts beside --use_dynamic_batch, which ignores them there too)
        rows = [f"--{name}" for section, name in _MICRO_ROWS if _set(getattr(cfg, section), name)]
        if rows:
            notices.append(
                f"{', '.join(rows)} {'sizes' if len(rows) == 1 else 'size'} no micro-batch with --use_dynamic_batch: "
                "micro-batches are filled up to a token budget (--train_max_tokens_per_gpu, "
                "--rollout_max_tokens_per_gpu)"
            )
    if cfg.data.eval_at_start and not cfg.data.eval_dataset:
        notices.append("--eval_at_start has no effect without --eval_dataset: there is nothing to evaluate")
    if algo.normalize_reward and not m.reward_pretrain:
        source = "--agent_func_path" if cfg.rollout.agent_func_path else "--remote_rm_url"
        notices.append(
            f"--normalize_reward has no effect with {source}: it applies the mean/std stored with a "
            f"--reward_pretrain model; scale the rewards in the reward function instead"
        )
    if cfg.train.full_determinism and cfg.rollout.async_train:
        notices.append(
            "--full_determinism with --async_train: every batch is seeded, but which weights generate it "
            "depends on timing, so runs are not reproducible step for step"
        )
    if cfg.rollout.partial_rollout and not cfg.rollout.async_train:
        notices.append(
            "--partial_rollout has no effect without --async_train: a synchronous step never syncs the weights "
            "while the engines generate"
        )
    if (notice := aux_loss_notice(cfg.model.aux_loss_coef, cfg.model.pretrain)) is not None:
        notices.append(notice)
    if cfg.rollout.share_prompt_in_group == "on" and cfg.rollout.n_samples_per_prompt == 1:
        notices.append("--share_prompt_in_group has no effect with --n_samples_per_prompt 1: no prompt has two rows")
    if cfg.logging.logging_steps > 1:
        notices.append(
            f"--logging_steps {cfg.logging.logging_steps} thins only the progress lines on stdout; "
            f"metrics.jsonl, TensorBoard and W&B get every step"
        )
    if m.save_value_network and algo.advantage_estimator != "gae":
        notices.append(
            f"--save_value_network has no effect: --advantage_estimator {algo.advantage_estimator} trains no critic"
        )
    if algo.kl_target is not None:
        notices.append(
            f"--kl_target {algo.kl_target} is in nats per response (the KL summed over a response, as in Ziegler "
            f"et al.); OpenRLHF's is the per-token mean: multiply an OpenRLHF value by the mean response length"
        )
    teachers = len(m.teacher_pretrain)
    if not teachers and (algo.distill_task_coef or cfg.data.teacher_key):
        flag = "--distill_task_coef" if algo.distill_task_coef else "--teacher_key"
        notices.append(f"{flag} has no effect without --teacher_pretrain: nothing is distilled")
    rewarded = m.reward_pretrain or m.remote_rm_url or cfg.rollout.agent_func_path
    if teachers and not rewarded and cfg.data.eval_dataset:
        notices.append(
            "--eval_dataset: pass@k counts rewards, and this run has no reward source (distillation alone): every "
            "eval reward is 0; add --remote_rm_url to evaluate"
        )
    if teachers == 1 and cfg.data.teacher_key:
        notices.append("--teacher_key has no effect with one --teacher_pretrain: every prompt goes to it")
    if teachers and not algo.distill_task_coef and rewarded:
        notices.append(
            "--distill_task_coef 0: the task reward is logged (train/reward) but not trained on; the advantage is "
            "the teacher's alone"
        )
    if algo.kl_estimator != "k1" and not algo.use_kl_loss and needs_reference(cfg):
        notices.append(
            f"--kl_estimator {algo.kl_estimator} as a reward penalty: its expectation is the KL, but as "
            f"a reward its policy gradient is not the KL's (k1's is); {algo.kl_estimator} is meant for "
            f"--use_kl_loss"
        )


def validate(cfg: PPOConfig, on_gpu: bool) -> list[str]:
    """Raise UserError on anything that cannot run; return one-line notices about no-ops on these devices."""
    return validate_flags(cfg) + validate_devices(cfg, on_gpu)


def _agent_program(cfg: PPOConfig, notices: list[str]) -> None:
    r = cfg.rollout
    require(r.agent_timeout > 0, f"--agent_timeout must be positive (seconds), got {r.agent_timeout}")
    require(r.agent_concurrency >= 0, f"--agent_concurrency must be >= 0 (0: all at once), got {r.agent_concurrency}")
    if not r.agent_program:
        if r.agent_tool_parser and not r.agent_func_path:  # (a Molt chat agent file is played through the endpoint)
            notices.append(f"--agent_tool_parser {r.agent_tool_parser} has no effect without --agent_program")
        return
    if r.agent_func_path:
        raise UserError(
            "--agent_program and --agent_func_path both given: an agent is either an OpenAI-API program "
            "(--agent_program) or an openppo AgentEnv file (--agent_func_path); pick one"
        )
    if cfg.data.apply_chat_template:
        raise UserError(
            "--apply_chat_template with --agent_program: the endpoint renders each of the agent's requests with the "
            "chat template, and the agent gets the data set's text; drop --apply_chat_template"
        )
    if r.agent_tool_parser:
        from openppo.agents.endpoint import tool_parser_names

        known = tool_parser_names()
        require(
            r.agent_tool_parser in known,
            f"--agent_tool_parser {r.agent_tool_parser}: vLLM has no such tool parser; it has: {', '.join(known)}",
        )
    if r.agent_host not in ("127.0.0.1", "localhost", "::1"):
        notices.append(
            f"--agent_host {r.agent_host}: the agent endpoint is reachable from other machines (it takes no files "
            f"or code from requests, and has no authentication)"
        )


def _images(cfg: PPOConfig, notices: list[str]) -> None:
    """Image prompts (--max_images_per_prompt > 0) take the padded path of a vision-language actor (docs/vlm.md),
    single-turn or an --agent_func_path environment's turns; every model that scores their rows must see the
    images."""
    d, r, m = cfg.data, cfg.rollout, cfg.model
    require(d.max_images_per_prompt >= 0, f"--max_images_per_prompt must be >= 0, got {d.max_images_per_prompt}")
    if d.max_images_per_prompt == 0:  # (a text run reads no model config here)
        if m.freeze_visual_encoder and m.pretrain and _is_vision_language(m.pretrain) is False:
            notices.append(f"--freeze_visual_encoder has no effect: {m.pretrain} has no vision tower")
        if d.image_key != "images":  # (a recipe that names the column but not the cap trains on text only)
            notices.append(
                f"--image_key {d.image_key} has no effect with --max_images_per_prompt 0 (text only): set "
                "--max_images_per_prompt to read the column's images"
            )
        return
    vision = _is_vision_language(m.pretrain) if m.pretrain else None
    require(
        vision is not False,
        f"--max_images_per_prompt {d.max_images_per_prompt}: {m.pretrain} is a text model (its config has no "
        "vision_config); pass a vision-language --pretrain or drop the image flags",
    )
    require(
        d.apply_chat_template, "--max_images_per_prompt: image prompts are chat messages; add --apply_chat_template"
    )
    refused = {
        "--packing_samples": r.packing_samples,
        "--ring_attn_size > 1": r.ring_attn_size > 1,
        "--share_prompt_in_group on": r.share_prompt_in_group == "on",
        "--agent_program": bool(r.agent_program),
        "--reward_pretrain": bool(m.reward_pretrain),
        "--teacher_pretrain": bool(m.teacher_pretrain),
        f"--advantage_estimator {cfg.algo.advantage_estimator} (a critic)": needs_critic_group(cfg),
    }
    for flag, given in refused.items():
        if given:
            raise UserError(
                f"{flag} with image prompts (--max_images_per_prompt): image rows are scored padded, one prompt per "
                "row, by the actor and the reference only (docs/vlm.md); drop one of the two"
            )


def _is_vision_language(path: str) -> bool | None:
    """Whether the model's config has a vision tower; None when the config cannot be read here (a missing folder
    fails in `_models` with its own message; a hub id is read where the run loads it)."""
    from transformers import AutoConfig

    from openppo.models.vision import is_vision_language

    try:
        return is_vision_language(AutoConfig.from_pretrained(path, trust_remote_code=True))
    except (OSError, ValueError):
        return None


def validate_flags(cfg: PPOConfig) -> list[str]:
    """The checks and notices that need no device: train_ppo_ray runs them before it connects to Ray, so that a
    wrong flag fails at once."""
    require(
        bool(cfg.data.prompt_data),
        "--prompt_data is required: a local .jsonl/.json/.parquet/.csv file or folder of prompts",
    )
    notices: list[str] = []
    _models(cfg)
    _algorithm(cfg)
    _sequence_parallel(cfg)
    _shared_prompts(cfg)
    _tensor_parallel(cfg)
    _batches(cfg)
    _resources(cfg, notices)
    _no_effect(cfg, notices)
    _agent_program(cfg, notices)
    _images(cfg, notices)
    validate_outputs(cfg.ckpt, cfg.logging)
    return notices


def check_reward_normalization(cfg: PPOConfig, mean_std: tuple[float, float]) -> tuple[float, float]:
    """The reward model's saved (mean, std), once it has loaded: --normalize_reward divides by the std."""
    std = mean_std[1]
    require(
        not cfg.algo.normalize_reward or std > 0,
        f"--normalize_reward: the reward model's stored std must be > 0, got {std}; retrain the reward model with "
        f"statistics or drop --normalize_reward",
    )
    return mean_std
