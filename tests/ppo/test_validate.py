"""PPO config validation: every contradiction names both flags; no-ops on CPU are notices, not errors."""

from __future__ import annotations

import re

import pytest

from openppo.config.schema import parse_config
from openppo.errors import UserError
from openppo.ppo.config import PPOConfig
from openppo.ppo.validate import check_reward_normalization, validate
from tests.model_cache import tiny_model_dir, tiny_vlm_dir


@pytest.fixture(scope="module")
def base():
    model = str(tiny_model_dir())
    return [
        "--pretrain",
        model,
        "--prompt_data",
        "prompts.jsonl",
        "--remote_rm_url",
        "reward.py",
        "--advantage_estimator",
        "group_norm",
        "--n_samples_per_prompt",
        "4",
        "--rollout_batch_size",
        "4",
        "--train_batch_size",
        "8",
        "--micro_train_batch_size",
        "2",
        "--actor_num_gpus_per_node",
        "2",
        "--vllm_num_engines",
        "1",
        "--init_kl_coef",
        "0",
    ]


def _cfg(base, extra):
    return parse_config(PPOConfig, base + extra, "t")


BAD = [
    # (extra flags, flags the message must name)
    (["--pretrain", "/nonexistent"], ["--pretrain"]),
    (["--reward_pretrain", "{model}"], ["--reward_pretrain", "--remote_rm_url"]),
    (["--critic_pretrain", "{model}"], ["--critic_pretrain", "--advantage_estimator"]),
    (["--n_samples_per_prompt", "1", "--train_batch_size", "4"], ["--advantage_estimator", "--n_samples_per_prompt"]),
    (["--kl_unbiased_gradient", "--init_kl_coef", "0.01"], ["--kl_unbiased_gradient", "--use_kl_loss"]),
    (["--vllm_enable_sleep"], ["--vllm_enable_sleep", "--colocate_all_models"]),
    (["--deepspeed_enable_sleep", "--adam_offload"], ["--deepspeed_enable_sleep", "--adam_offload"]),
    (["--colocate_all_models", "--vllm_num_engines", "1"], ["--colocate_all_models", "--vllm_num_engines"]),
    (
        ["--colocate_all_models", "--vllm_num_engines", "2", "--vllm_tensor_parallel_size", "2"],
        ["--colocate_all_models", "--vllm_tensor_parallel_size"],
    ),
    (["--param_dtype", "fp16"], ["--param_dtype"]),
    (["--train_batch_size", "6"], ["--train_batch_size"]),
    (["--micro_train_batch_size", "3"], ["--micro_train_batch_size"]),
    (["--dual_clip", "0.5"], ["--dual_clip"]),
    (["--gamma", "0.99"], ["--gamma", "--advantage_estimator"]),
    (["--generate_max_len", "-1"], ["--generate_max_len"]),
    (["--max_len", "1"], ["--max_len"]),
    (["--overlong_buffer_len", "5000"], ["--overlong_buffer_len", "--generate_max_len"]),
    (["--reward_clip_range", "1", "-1"], ["--reward_clip_range"]),
    (["--top_p", "0"], ["--top_p"]),
    (["--top_k", "0"], ["--top_k"]),
    (["--kl_target", "0.1"], ["--kl_target", "--init_kl_coef"]),
    (
        ["--async_train", "--colocate_all_models", "--vllm_enable_sleep", "--vllm_num_engines", "2"],
        ["--async_train", "--vllm_enable_sleep"],
    ),
    (["--async_train", "--async_queue_size", "0"], ["--async_queue_size"]),
    (["--ds_tensor_parallel_size", "4"], ["--ds_tensor_parallel_size", "--actor_num_gpus_per_node"]),
    (["--ds_tensor_parallel_size", "0"], ["--ds_tensor_parallel_size"]),
    (["--ds_tensor_parallel_size", "2", "--zero_stage", "3"], ["--ds_tensor_parallel_size", "--zero_stage"]),
    (
        ["--ds_tensor_parallel_size", "2", "--ring_attn_size", "2", "--packing_samples"],
        ["--ds_tensor_parallel_size", "--ring_attn_size"],
    ),
    (["--ds_tensor_parallel_size", "2", "--lora_rank", "4"], ["--ds_tensor_parallel_size", "--lora_rank"]),
    (["--ds_tensor_parallel_size", "2", "--optim", "muon"], ["--ds_tensor_parallel_size", "--optim muon"]),
    (["--use_dynamic_batch", "--train_max_tokens_per_gpu", "0"], ["--train_max_tokens_per_gpu"]),
    (["--torch_compile", "--zero_stage", "3"], ["--torch_compile", "--zero_stage"]),
    (["--torch_compile", "--ring_attn_size", "2", "--packing_samples"], ["--torch_compile", "--ring_attn_size"]),
    (["--torch_compile", "--ds_tensor_parallel_size", "2"], ["--torch_compile", "--ds_tensor_parallel_size"]),
    (["--torch_compile", "--use_liger_kernel"], ["--use_liger_kernel", "--torch_compile", "non-finite"]),
    (["--ring_attn_size", "2"], ["--ring_attn_size", "--packing_samples"]),
    (["--ring_attn_size", "3", "--packing_samples"], ["--ring_attn_size", "--actor_num_gpus_per_node"]),
    (["--ring_attn_size", "2", "--packing_samples", "--ring_head_stride", "-1"], ["--ring_head_stride"]),
    (
        ["--colocate_actor_ref", "--ref_num_gpus_per_node", "1", "--init_kl_coef", "0.01"],
        ["--colocate_actor_ref", "--ref_num_gpus_per_node"],
    ),
    (
        ["--colocate_all_models", "--vllm_num_engines", "2", "--init_kl_coef", "0.01"],
        ["--colocate_all_models", "--ref_num_gpus_per_node"],
    ),
    (["--deepspeed_enable_sleep", "--zero_stage", "0"], ["--deepspeed_enable_sleep", "--zero_stage"]),
    (["--agent_func_path", "agent.py"], ["--agent_func_path", "--remote_rm_url"]),
    (["--save_steps", "0"], ["--save_steps"]),
    (["--eval_steps", "0"], ["--eval_steps"]),
    (["--eval_dataset", "e.jsonl", "--eval_n_samples_per_prompt", "0"], ["--eval_n_samples_per_prompt"]),
    (["--eval_dataset", "e.jsonl", "--eval.top_p", "0"], ["--eval_top_p"]),
    (["--train.force_on_policy", "--max_epochs", "2"], ["--force_on_policy", "--max_epochs"]),
    (["--train.force_sync_mode", "--async_train"], ["--force_sync_mode", "--async_train"]),
    (["--eval_dataset", "e.jsonl", "--eval.batch_size", "0"], ["--eval_batch_size"]),
    (["--eval.eval_only"], ["--eval_only", "--eval_dataset"]),
    (
        ["--train.rollout_dump_dir", "d", "--train.rollout_replay_dir", "d"],
        ["--rollout_dump_dir", "--rollout_replay_dir"],
    ),
    # an agent's turns keep the rollout's sampling
    (
        ["--remote_rm_url", "", "--agent_func_path", "a.py", "--eval_dataset", "e.jsonl", "--eval.max_new_tokens", "4"],
        ["--eval_max_new_tokens"],
    ),
    (["--dynamic_filtering_reward_range", "1", "0"], ["--dynamic_filtering_reward_range"]),
    (["--load_checkpoint", "--disable_ds_ckpt"], ["--load_checkpoint", "--disable_ds_ckpt"]),
    (["--ema_beta", "1.5"], ["--ema_beta"]),
    (["--enable_ema", "--lora_rank", "4"], ["--enable_ema", "--lora_rank"]),
    (["--vllm_generate_batch_size", "16"], ["--vllm_generate_batch_size", "--async_train"]),
    (["--share_prompt_in_group", "on"], ["--share_prompt_in_group", "--packing_samples"]),
    (
        ["--share_prompt_in_group", "on", "--packing_samples", "--ring_attn_size", "2"],
        ["--share_prompt_in_group", "--ring_attn_size"],
    ),
    (
        ["--share_prompt_in_group", "on", "--packing_samples", "--attn_implementation", "eager"],
        ["--share_prompt_in_group", "--attn_implementation"],
    ),
    (
        ["--vllm_generate_batch_size", "1", "--async_train", "--vllm_num_engines", "1"],
        ["--vllm_generate_batch_size", "--rollout_batch_size"],
    ),
    # image prompts ({vlm}: the tiny vision-language model)
    (["--max_images_per_prompt", "-1"], ["--max_images_per_prompt"]),
    (["--max_images_per_prompt", "1", "--apply_chat_template"], ["--max_images_per_prompt", "--pretrain"]),
    (["--pretrain", "{vlm}", "--max_images_per_prompt", "1"], ["--max_images_per_prompt", "--apply_chat_template"]),
    (
        ["--pretrain", "{vlm}", "--max_images_per_prompt", "1", "--apply_chat_template", "--packing_samples"],
        ["--packing_samples", "--max_images_per_prompt"],
    ),
    (
        ["--pretrain", "{vlm}", "--data.max_images_per_prompt", "1", "--apply_chat_template"]
        + ["--advantage_estimator", "gae"],
        ["--advantage_estimator", "--max_images_per_prompt"],
    ),
]


BAD += [
    (["--vllm_block_size", "48"], ["--vllm_block_size"]),  # vLLM's CPU attention takes multiples of 32
    (["--vllm_max_num_batched_tokens", "0"], ["--vllm_max_num_batched_tokens"]),
    # a whole sample must fit one scheduler step when prefills are not chunked
    (["--vllm_max_num_batched_tokens", "16", "--no-vllm_enable_chunked_prefill"], ["--vllm_max_num_batched_tokens"]),
]


@pytest.mark.parametrize("extra,flags", BAD, ids=[" ".join(e[:2]) for e, _ in BAD])
def test_bad_config_names_flags(base, extra, flags):
    extra = [e.replace("{model}", base[1]).replace("{vlm}", str(tiny_vlm_dir())) for e in extra]
    with pytest.raises(UserError) as err:
        validate(_cfg(base, extra), on_gpu=False)
    message = str(err.value)
    assert "\n" not in message
    for flag in flags:
        assert re.search(re.escape(flag) + r"\b", message), (flag, message)


def test_max_len_caps_each_response_by_what_its_prompt_leaves():
    from openppo.ppo.config import PromptDataConfig

    d = PromptDataConfig(prompt_max_len=100, generate_max_len=50)
    assert (d.total_len(), d.prompt_limit(), d.response_budget(80)) == (150, 100, 50)  # no --max_len: the sum
    d.max_len = 120  # OpenRLHF's --max_len: prompt + response
    assert (d.total_len(), d.prompt_limit()) == (120, 100)
    assert [d.response_budget(n) for n in (10, 70, 100)] == [50, 50, 20]
    d.max_len = 60  # shorter than the longest prompt: a prompt must leave room for one response token
    assert (d.total_len(), d.prompt_limit(), d.response_budget(59)) == (60, 59, 1)


def test_colocate_all_models_with_async_train_colocates_the_deepspeed_models_only(base):
    """OpenRLHF's rule (its async agent recipe gives both flags): the engines generate on devices of their own, so
    their count need not match the actor's ranks (2 here) as the hybrid engine's must; the reference, critic and
    reward model still share the actor's devices, so their sizes must match it."""
    flags = ["--async_train", "--colocate_all_models", "--vllm_num_engines", "3"]
    notices = validate(_cfg(base, flags), on_gpu=False)
    assert (
        "--colocate_all_models with --async_train colocates the DeepSpeed models only (as OpenRLHF does): the vLLM "
        "engines generate on 3 device(s) of their own while the trainer works" in notices
    ), notices
    with pytest.raises(UserError, match="--colocate_all_models needs --vllm_num_engines"):
        validate(_cfg(base, flags[1:]), on_gpu=False)
    with pytest.raises(UserError, match="--colocate_all_models puts every model on the actor's devices: set --ref_num"):
        validate(_cfg(base, [*flags, "--init_kl_coef", "0.01"]), on_gpu=False)


def test_valid_config_gives_cpu_notices(base):
    notices = validate(_cfg(base, []), on_gpu=False)
    assert any("worker processes" in n for n in notices)
    assert any("gloo" in n for n in notices)
    assert not any("--kl_target" in n for n in notices)


def test_save_value_network_without_a_critic_says_so(base):
    notices = validate(_cfg(base, ["--save_value_network", "--advantage_estimator", "group_norm"]), on_gpu=False)
    assert any(n.startswith("--save_value_network has no effect") for n in notices), notices


def test_kl_target_says_its_unit_is_not_openrlhfs(base):
    notices = validate(_cfg(base, ["--kl_target", "6", "--init_kl_coef", "0.01"]), on_gpu=False)
    [unit] = [n for n in notices if n.startswith("--kl_target 6.0 is in nats per response")]
    assert "per-token mean" in unit and "\n" not in unit


def test_tensor_parallel_reaches_the_deepspeed_config_of_the_actor_only(base):
    import dataclasses

    from openppo.ppo.plan import make_plan
    from openppo.ppo.workers import make_strategy

    cfg = _cfg(base, ["--ds_tensor_parallel_size", "2", "--param_dtype", "fp32"])
    validate(cfg, on_gpu=False)
    role = make_plan(cfg, num_prompts=16).roles["actor"]
    assert (role.ranks, role.tensor_parallel, role.data_parallel) == (2, 2, 1)
    critic_role = dataclasses.replace(role, name="critic", tensor_parallel=1)  # a critic on the same 2 ranks
    actor, critic = make_strategy(cfg, role), make_strategy(cfg, critic_role)
    actor.world_size = critic.world_size = 2
    assert actor.train_config()["tensor_parallel"] == {"autotp_size": 2, "vocab_parallel_lm_head": False}
    # the 2 ranks train on the same rows: DeepSpeed's batch counts both
    assert actor.train_config()["train_batch_size"] == 16 and actor.grad_accum_steps == 4
    assert "tensor_parallel" not in critic.train_config() and critic.grad_accum_steps == 2


def test_deepcompile_is_gpu_only_and_reaches_the_deepspeed_config(base):
    from openppo.strategy.config import train_ds_config

    with pytest.raises(UserError, match="--deepcompile needs a GPU"):
        validate(_cfg(base, ["--deepcompile"]), on_gpu=False)
    cfg = _cfg(base, ["--deepcompile", "--zero_stage", "3"])
    validate(cfg, on_gpu=True)
    ds = train_ds_config(cfg.ds, train_batch_size=8, micro_batch_size=2, world_size=2, max_norm=1.0, on_gpu=True)
    assert ds["compile"] == {"deepcompile": True}


def test_colocation_and_sleep_notices_on_cpu(base):
    notices = validate(
        _cfg(
            base,
            [
                "--colocate_all_models",
                "--vllm_num_engines",
                "2",
                "--vllm_enable_sleep",
                "--deepspeed_enable_sleep",
                "--zero_stage",
                "3",
                "--colocate_actor_ref",
            ],
        ),
        on_gpu=False,
    )
    assert any("--vllm_enable_sleep is a no-op on CPU" in n for n in notices)
    assert any("--deepspeed_enable_sleep with --zero_stage 3 on CPU" in n for n in notices)
    assert any("--colocate_actor_ref: no reference model" in n for n in notices)
    # ZeRO-2 offloads for real on CPU: no notice about it
    notices = validate(_cfg(base, ["--deepspeed_enable_sleep", "--zero_stage", "2"]), on_gpu=False)
    assert not any("--deepspeed_enable_sleep" in n for n in notices)


# Accepted, valid, and without effect in that run: each says so in one line at start (flags, what the line names).
NO_EFFECT = [
    (["--normalize_reward"], "--normalize_reward has no effect with --remote_rm_url"),
    (
        ["--ref_reward_offload", "--init_kl_coef", "0.01", "--zero_stage", "2"],
        "--ref_reward_offload has no effect with --zero_stage 2",
    ),
    (["--zpg", "2", "--zero_stage", "2"], "--zpg 2 has no effect with --zero_stage 2"),
    (["--adam_offload"], "--adam_offload saves no memory on CPU"),
    (["--use_liger_kernel"], "--use_liger_kernel has no effect on CPU"),
    (["--logging_steps", "5"], "--logging_steps 5 thins only the progress lines on stdout"),
    (["--init_kl_coef", "0.01", "--kl_estimator", "k3"], "--kl_estimator k3 as a reward penalty"),
    (["--init_kl_coef", "0.01", "--kl_estimator", "k2"], "--kl_estimator k2 as a reward penalty"),
    (["--enforce_eager"], "vLLM runs eager (CUDA graphs and --enforce_eager do not apply)"),
    (["--full_determinism", "--async_train"], "--full_determinism with --async_train"),
    (["--partial_rollout"], "--partial_rollout has no effect without --async_train"),
    (["--aux_loss_coef", "0.01"], "--aux_loss_coef has no effect"),  # the dense tiny model has no router
    (["--lambd", "0.95"], "--lambd has no effect with --advantage_estimator group_norm: only gae trains a critic"),
    (["--value_clip", "0.2"], "--value_clip has no effect with --advantage_estimator group_norm"),
    (["--critic_learning_rate", "1e-5"], "--critic_learning_rate has no effect with --advantage_estimator"),
    (["--freezing_actor_steps", "3"], "--freezing_actor_steps has no effect with --advantage_estimator"),
    (["--critic_max_epochs", "2"], "--critic_max_epochs has no effect with --advantage_estimator"),
    (["--lambd", "0.9", "--value_clip", "0.1"], "--lambd, --value_clip have no effect with --advantage_estimator"),
    (["--kl_horizon", "500"], "--kl_horizon has no effect without --kl_target"),
    # (OpenRLHF 0.11.0's VLM recipe gives both; base has --init_kl_coef 0)
    (["--use_kl_loss"], "--use_kl_loss has no effect with --init_kl_coef 0: no reference model runs"),
    (["--eval.eval_at_start"], "--eval_at_start has no effect without --eval_dataset"),
    (["--train.force_sync_mode"], "--force_sync_mode has no effect: without --async_train"),
    (["--no_advantage_whiten"], "--no_advantage_whiten has no effect with --advantage_estimator group_norm"),
    (["--no_advantage_std_norm"], "--no_advantage_std_norm has no effect with --advantage_estimator group_norm"),
    (["--freeze_visual_encoder"], "--freeze_visual_encoder has no effect:"),
    (["--image_key", "pics"], "--image_key pics has no effect with --max_images_per_prompt 0 (text only)"),
    (["--vllm_attention_backend", "TRITON_ATTN"], "--vllm_attention_backend has no effect on CPU"),
    # (base gives --micro_train_batch_size 2)
    (["--use_dynamic_batch"], "--micro_train_batch_size sizes no micro-batch with --use_dynamic_batch"),
    (
        ["--use_dynamic_batch", "--micro_rollout_batch_size", "16"],
        "--micro_train_batch_size, --micro_rollout_batch_size size no micro-batch with --use_dynamic_batch",
    ),
    (["--vllm.disable_custom_all_reduce"], "--vllm_disable_custom_all_reduce has no effect on CPU"),
    (
        ["--advantage_estimator", "reinforce", "--n_samples_per_prompt", "1", "--train_batch_size", "4"]
        + ["--packing_samples", "--share_prompt_in_group", "on"],
        "--share_prompt_in_group has no effect with --n_samples_per_prompt 1",
    ),
]


@pytest.mark.parametrize("extra,line", NO_EFFECT, ids=[e[0] for e, _ in NO_EFFECT])
def test_options_without_effect_say_so_in_one_line(base, extra, line):
    notices = validate(_cfg(base, extra), on_gpu=False)
    said = [n for n in notices if line in n]
    assert len(said) == 1 and "\n" not in said[0], notices
    # without the option nothing is said of it (the eager line is part of the CPU notice, said on every CPU run)
    if line.startswith("--"):
        flag = line.split(" ")[0]
        assert not any(flag in n for n in validate(_cfg(base, []), on_gpu=False))


def test_options_with_effect_say_nothing(base):
    model = base[1]
    quiet = {
        "--normalize_reward": ["--normalize_reward", "--reward_pretrain", model, "--remote_rm_url", ""],
        "--ref_reward_offload": ["--ref_reward_offload", "--init_kl_coef", "0.01", "--zero_stage", "3"],
        "--zpg": ["--zpg", "2", "--zero_stage", "3"],
        "--kl_estimator": ["--init_kl_coef", "0.01", "--kl_estimator", "k3", "--use_kl_loss"],
        "--kl_unbiased_gradient": ["--init_kl_coef", "0.01", "--use_kl_loss", "--kl_unbiased_gradient"],
        # a critic reads them; an adaptive KL controller reads its horizon
        "--lambd": ["--advantage_estimator", "gae", "--lambd", "0.95", "--value_clip", "0.2"],
        "--kl_horizon": ["--init_kl_coef", "0.01", "--kl_target", "6", "--kl_horizon", "500"],
        "--no_advantage_whiten": ["--advantage_estimator", "reinforce", "--no_advantage_whiten"],
        "--no_advantage_std_norm": ["--advantage_estimator", "reinforce", "--no_advantage_std_norm"],
    }
    for flag, extra in quiet.items():
        notices = validate(_cfg(base, extra), on_gpu=False)
        assert not any(n.startswith(flag) for n in notices), (flag, notices)
    assert not any("--adam_offload" in n for n in validate(_cfg(base, ["--adam_offload"]), on_gpu=True))
    moe = ["--pretrain", str(tiny_model_dir(arch="qwen3_moe")), "--aux_loss_coef", "0.01"]
    assert not any("--aux_loss_coef" in n for n in validate(_cfg(base, moe), on_gpu=False))


def test_sync_check_refuses_a_mixture_of_experts(base):
    """--vllm_sync_check reads back dense layers only."""
    moe = ["--pretrain", str(tiny_model_dir(arch="qwen3_moe"))]
    with pytest.raises(UserError, match="^--vllm_sync_check reads back dense layers only"):
        validate(_cfg(base, [*moe, "--vllm_sync_check"]), on_gpu=False)


def test_router_loss_rules(base):
    """--aux_loss_coef is not a ring's (each ring rank routes only its chunk of a row), and not negative."""
    moe = ["--pretrain", str(tiny_model_dir(arch="qwen3_moe"))]
    ring = ["--ring_attn_size", "2", "--packing_samples", "--aux_loss_coef", "0.01"]
    with pytest.raises(UserError, match="^--aux_loss_coef with --ring_attn_size"):
        validate(_cfg(base, [*moe, *ring]), on_gpu=False)
    with pytest.raises(UserError, match="--aux_loss_coef must be >= 0"):
        validate(_cfg(base, ["--aux_loss_coef", "-1"]), on_gpu=False)


LOSS_RULES = [
    # the RL math's rules: checked only here, with the flag's name (the math raises a plain ValueError)
    (["--kl_target", "0.1", "--init_kl_coef", "0.01", "--kl_horizon", "0"], "--kl_horizon"),
    (["--lambd", "1.5"], "--lambd"),
    (["--ring_attn_size", "2", "--packing_samples", "--ring_head_stride", "3"], "--ring_head_stride"),  # 2 KV heads
    (["--dual_clip", "1"], "--dual_clip"),
    (["--policy_loss_type", "cispo", "--dual_clip", "3"], "--dual_clip"),
    (["--reward_clip_range", "1", "1"], "--reward_clip_range"),
    (["--overlong_buffer_len", "0"], "--overlong_buffer_len"),
    (["--top_k", "0"], "--top_k"),
    (["--top_p", "0"], "--top_p"),
    (["--eps_clip", "1.0"], "--eps_clip"),
    (["--eps_clip", "0"], "--eps_clip"),
    (["--eps_clip_low_high", "1.0", "0.28"], "--eps_clip_low_high"),
    (
        ["--value_clip", "0", "--advantage_estimator", "gae", "--n_samples_per_prompt", "1", "--train_batch_size", "4"],
        "--value_clip",
    ),
    (["--vllm_is_truncated_threshold", "2", "1"], "--vllm_is_truncated_threshold"),
    (["--overlong_buffer_len", "4", "--overlong_penalty_factor", "-1"], "--overlong_penalty_factor"),
    (["--stop_properly_penalty_coef", "2"], "--stop_properly_penalty_coef"),
]


@pytest.mark.parametrize("extra,flag", LOSS_RULES, ids=[" ".join(e[:2]) for e, _ in LOSS_RULES])
def test_what_the_losses_reject_fails_validation(base, extra, flag):
    with pytest.raises(UserError, match=re.escape(flag) + r"\b") as err:
        validate(_cfg(base, extra), on_gpu=False)
    assert "\n" not in str(err.value)


def test_role_ranks_against_the_batch(base):
    # a reference on 3 ranks takes 16 samples dealt 6/5/5 (forward only): accepted
    validate(_cfg(base, ["--init_kl_coef", "0.01", "--ref_num_gpus_per_node", "3"]), on_gpu=False)
    # a critic trains: --train_batch_size 8 over 3 critic ranks of micro-batches of 2 does not divide
    gae = ["--advantage_estimator", "gae", "--n_samples_per_prompt", "1", "--rollout_batch_size", "16"]
    with pytest.raises(
        UserError,
        match=r"--train_batch_size 8 .* 3 data-parallel critic ranks .*"
        r"--critic_num_gpus_per_node",
    ):
        validate(_cfg(base, gae + ["--critic_num_gpus_per_node", "3"]), on_gpu=False)
    # more reward-model ranks than samples: one would get no row
    with pytest.raises(UserError, match=r"16 samples per step cannot feed 32 data-parallel reward ranks"):
        validate(
            _cfg(base, ["--reward_pretrain", base[1], "--remote_rm_url", "", "--reward_num_gpus_per_node", "32"]),
            on_gpu=False,
        )


def test_a_reward_model_without_a_std_fails_normalize_reward(base):
    cfg = _cfg(base, ["--normalize_reward"])
    assert check_reward_normalization(cfg, (0.5, 2.0)) == (0.5, 2.0)
    with pytest.raises(UserError, match=r"^--normalize_reward: the reward model's stored std must be > 0, got 0.0"):
        check_reward_normalization(cfg, (0.0, 0.0))
    assert check_reward_normalization(_cfg(base, []), (0.0, 0.0)) == (0.0, 0.0)  # not used without the flag
