"""Config of `train_ppo_ray`: every flag of the OpenRLHF recipes, grouped by component.

Defaults follow OpenRLHF where its users rely on them, except where a default there is a known trap (noted on the
field). The resources group counts GPUs per node; on a machine without GPUs the same numbers count worker
processes (said once at start).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from openppo.algorithms import (
    ADVANTAGE_ESTIMATORS,
    IS_CORRECTION_TYPES,
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    POLICY_LOSS_TYPES,
    SamplingFilter,
)
from openppo.config.common import (
    LR_SCHEDULERS,
    CheckpointConfig,
    LoggingConfig,
    ModelBuildConfig,
    OptimizerChoice,
    value_head_prefix_opt,
)
from openppo.config.schema import opt
from openppo.distributed.placement import STRATEGIES
from openppo.strategy.config import DeepSpeedConfig

# --train_max_tokens_per_gpu where not given: on CPU (and on GPUs whose plan does not fit at any budget) OpenRLHF's
# order of size; on GPUs the launch sizes it to the device (`memory_plan.default_token_budget`), up to the largest
# measured to help: 32768 tokens moved 1.35-1.47x the tokens a second of 8192 on an H200, whose 0.5B step was 94 %
# kernel-bound there already (docs/benchmarks.md); larger ones are unmeasured and cost memory.
DEFAULT_TRAIN_TOKENS = 16384
AUTO_TRAIN_TOKENS_MAX = 32768


@dataclass
class PPOModelConfig(ModelBuildConfig):
    """Models: actor, critic, reward, and how they are built (build options apply to actor and critic)."""

    pretrain: str = opt(None, "actor (policy) model folder; also the tokenizer and the reference model", metavar="PATH")
    critic_pretrain: str = opt(
        None,
        "critic start point (gae only); default: --reward_pretrain, else --pretrain (value head then starts random)",
        metavar="PATH",
    )
    reward_pretrain: str = opt(None, "reward model folder (a scalar-head model, e.g. from train_rm)", metavar="PATH")
    remote_rm_url: str = opt(
        None,
        "reward source instead of a reward model: comma list of HTTP endpoints "
        "(python -m openppo.cli.serve_rm) or a .py file exporting reward_func",
    )
    remote_rm_timeout: float = opt(60.0, "seconds one reward request may take (HTTP sources) before it is retried")
    reward_func_timeout: float = opt(
        600.0,
        "seconds a .py --remote_rm_url's reward_func may take on one batch; a late call stops the run with an error "
        "naming it (with --remote_rm_default_reward: the batch gets that reward)",
    )
    remote_rm_retries: int = opt(
        3,
        "retries of a failed reward request (connection error, timeout, HTTP 5xx), "
        "with exponential backoff from 1 s; a 4xx is not retried",
    )
    remote_rm_default_reward: float = opt(
        None,
        "reward given to the samples whose reward source keeps failing (or "
        "whose reward_func raises), with a warning; default: stop the run "
        "with an error that shows the sample",
    )
    ref_reward_offload: bool = opt(
        False, "offload reference, reward and teacher model weights to CPU (ZeRO-3 param offload)"
    )
    teacher_pretrain: list[str] = opt(
        help="on-policy distillation: teacher model folder(s), NAME=PATH or PATH (named by its folder); each runs as a "
        "forward-only group and scores the student's sampled tokens (docs/algorithms.md). Its tokenizer must be the "
        "student's",
        factory=list,
        metavar="[NAME=]PATH",
    )
    freeze_visual_encoder: bool = opt(
        False,
        "a vision-language actor: train its language model only; the vision tower and connector stay as loaded "
        "(docs/vlm.md)",
    )
    value_head_prefix: str = value_head_prefix_opt()
    save_value_network: bool = opt(False, "also save the trained critic as an HF folder, <save_path>_critic (gae)")


@dataclass
class ResourceConfig:
    """Devices per model group and colocation (on CPU-only machines: worker processes)."""

    actor_num_nodes: int = opt(1, "nodes for the actor")
    actor_num_gpus_per_node: int = opt(1, "actor ranks per node (OpenRLHF defaults to 8)")
    critic_num_nodes: int = opt(1, "nodes for the critic")
    critic_num_gpus_per_node: int = opt(1, "critic ranks per node")
    ref_num_nodes: int = opt(1, "nodes for the reference model")
    ref_num_gpus_per_node: int = opt(1, "reference ranks per node")
    reward_num_nodes: int = opt(1, "nodes for the reward model")
    reward_num_gpus_per_node: int = opt(1, "reward-model ranks per node")
    teacher_num_nodes: int = opt(1, "nodes for each teacher model (--teacher_pretrain)")
    teacher_num_gpus_per_node: int = opt(1, "ranks per node of each teacher model")
    colocate_actor_ref: bool = opt(False, "actor and reference share devices")
    colocate_critic_reward: bool = opt(False, "critic and reward model share devices")
    colocate_all_models: bool = opt(
        False,
        "hybrid engine: every model and the vLLM engines share the actor's devices (with --async_train the "
        "DeepSpeed models only, as in OpenRLHF: the engines generate on devices of their own)",
    )
    placement_strategy: str = opt(
        "PACK",
        "how each group's devices (one per rank, or per pool of colocated groups) spread over the cluster's nodes, "
        "as Ray's placement strategies: PACK fills as few nodes as it can (OpenRLHF's), SPREAD spreads them where "
        "it can, STRICT_PACK keeps each group on one node, STRICT_SPREAD puts every rank of a group on a node of "
        "its own; vLLM engines of their own spread with SPREAD and STRICT_SPREAD. The node of every rank and engine "
        "is logged",
        choices=STRATEGIES,
    )


@dataclass
class VLLMConfig:
    """Rollout engines (vLLM) and the trainer -> engine weight sync."""

    vllm_num_engines: int = opt(1, "vLLM engines generating rollouts")
    max_engine_restarts: int = opt(
        3,
        "dead vLLM engines (process killed, vLLM's engine core lost) replaced in a run: a new engine starts on the "
        "same resources, gets the current weights and generates the lost prompts again (logged, counted in "
        "rollout/engine_restarts); past it the run stops naming the engine. 0: stop at the first death",
    )
    vllm_tensor_parallel_size: int = opt(
        1,
        "tensor-parallel size of each engine: its workers split every layer "
        "(GPUs; on CPU, worker processes on their own cores)",
    )
    vllm_gpu_memory_utilization: float = opt(
        0.9,
        "share of device memory for each engine; on CPU the most of the "
        "RAM left after the trainers' weights and optimizer states that "
        "the engines' KV caches may take",
    )
    vllm_kv_cache_bytes: int = opt(
        None,
        "KV cache of each engine worker in bytes (CPU); default on CPU: the "
        "rollout batch's sequences at full length x 1.25, within the share above "
        "(logged)",
    )
    vllm_sync_backend: str = opt(
        "nccl",
        "collective that broadcasts weights to engines on devices of their own "
        "(gloo on CPU); engines on actor ranks' devices (--colocate_all_models) "
        "get them by CUDA IPC / shared memory, in no group",
        choices=("nccl", "gloo"),
    )
    vllm_sync_with_ray: bool = opt(
        False,
        "send the weights to engines on devices of their own through Ray's object store instead of a "
        "--vllm_sync_backend group: no extra rendezvous or port, one copy per engine (slower for large models)",
    )
    vllm_sync_bucket_mb: int = opt(256, "weights per sync message (MiB): many tensors travel in one bucket")
    vllm_sync_delta: bool = opt(
        False,
        "after the first weight sync, send only the elements whose engine-dtype value changed (indices and "
        "values; logged as the share of elements and the full sync's size); actor rank 0 and each engine worker "
        "keep one more copy of the weights in host memory",
    )
    vllm_sync_check: bool = opt(
        False,
        "after the run's first weight sync (and its first delta sync with --vllm_sync_delta), read every "
        "engine's weights back as its kernels use them and compare each tensor with the trainer's; stop naming "
        "the tensor that differs (one extra copy of the weights on actor rank 0)",
    )
    enforce_eager: bool = opt(False, "disable CUDA graphs / torch.compile in vLLM (faster start, slower decode)")
    enable_prefix_caching: bool = opt(False, "reuse prompt KV across the n samples of a prompt; reset on every sync")
    vllm_dtype: str = opt(
        None,
        "the engines' weights and compute dtype (default: the trained model's --param_dtype); each sync casts the "
        "trainer's weights to it, and the log-prob gap to the trainer grows with the difference",
        choices=("bfloat16", "float16", "float32"),
    )
    vllm_block_size: int = opt(None, "tokens per KV cache block (default: vLLM's on GPU; on CPU 32, its multiples)")
    vllm_max_num_batched_tokens: int = opt(None, "the tokens vLLM's scheduler takes in one step (default: vLLM's)")
    vllm_enable_chunked_prefill: bool | None = opt(
        None, "vLLM splits long prefills over steps: on, or off with --no-vllm_enable_chunked_prefill (default: vLLM's)"
    )
    vllm_attention_backend: str = opt(
        None, "vLLM's attention kernels on GPU (FLASH_ATTN, FLASHINFER, TRITON_ATTN, ...; default: vLLM's choice)"
    )
    vllm_mm_encoder_attn_backend: str = opt(None, "vLLM's vision-encoder attention kernels on GPU (e.g. TORCH_SDPA)")
    vllm_gdn_prefill_backend: str = opt(
        None, "vLLM's prefill kernels of gated-delta-net layers (Qwen3.5) on GPU", choices=("flashinfer", "triton")
    )
    vllm_mamba_ssm_cache_dtype: str = opt(
        None,
        "dtype of vLLM's recurrent-state cache, read for models with Mamba or linear-attention layers (float32 keeps "
        "their long rollouts' log-probs close to the trainer's)",
        choices=("auto", "float32", "float16"),
    )
    vllm_disable_custom_all_reduce: bool = opt(
        False, "tensor-parallel engines reduce with NCCL instead of vLLM's custom all-reduce kernel (GPU)"
    )
    vllm_async_scheduling: bool | None = opt(
        None,
        "vLLM schedules the next step while the current one runs: on, or off with --no-vllm_async_scheduling "
        "(default: vLLM's)",
    )
    vllm_enable_sleep: bool = opt(
        False, "engines release memory while the trainer runs (needs --colocate_all_models; a no-op on CPU)"
    )
    enable_vllm_is_correction: bool = opt(False, "correct for vLLM / trainer log-prob mismatch with importance weights")
    vllm_is_truncated_threshold: tuple[float, float] = opt((0.5, 5.0), "low high bounds of the IS ratio")
    vllm_is_correction_type: str = opt("tis", "IS correction", choices=IS_CORRECTION_TYPES)

    def engine_args(self, on_gpu: bool) -> dict:
        """vLLM's own engine arguments the flags above pass through unchanged; unset ones stay vLLM's choice. The
        GPU kernel choices stay out of a CPU run (validation says so in one line each)."""
        given = {
            "block_size": self.vllm_block_size,
            "max_num_batched_tokens": self.vllm_max_num_batched_tokens,
            "enable_chunked_prefill": self.vllm_enable_chunked_prefill,
            "async_scheduling": self.vllm_async_scheduling,
            "mamba_ssm_cache_dtype": self.vllm_mamba_ssm_cache_dtype,
            **(self.gpu_engine_args() if on_gpu else {}),
        }
        return {name: value for name, value in given.items() if value is not None}

    def gpu_engine_args(self) -> dict:
        """The pass-through engine arguments that choose GPU kernels (given ones only)."""
        given = {
            "attention_backend": self.vllm_attention_backend,
            "mm_encoder_attn_backend": self.vllm_mm_encoder_attn_backend,
            "gdn_prefill_backend": self.vllm_gdn_prefill_backend,
            "disable_custom_all_reduce": self.vllm_disable_custom_all_reduce or None,
        }
        return {name: value for name, value in given.items() if value is not None}


@dataclass
class PPODeepSpeedConfig(DeepSpeedConfig, OptimizerChoice):
    """DeepSpeed ZeRO, precision and memory options of the trained models; the optimizer of the actor and critic."""

    adam_betas: tuple[float, float] = opt((0.9, 0.95), "Adam beta1 beta2")
    adam_eps: float = opt(1e-8, "Adam epsilon (added to the root of the second moment)")
    l2: float = opt(0.0, "weight decay")
    deepspeed_enable_sleep: bool = opt(False, "offload optimizer and gradient states while the engines generate")
    deepcompile: bool = opt(False, "compile the training engine with DeepSpeed's deepcompile (GPU)")
    ds_tensor_parallel_size: int = opt(
        1,
        "DeepSpeed AutoTP size of the actor's training engine: its weights are "
        "split over this many consecutive ranks, which train on the same rows "
        "(ZeRO <= 2; critic, reference and reward stay data-parallel)",
    )


@dataclass
class PPOLoggingConfig(LoggingConfig):
    """Metrics, experiment tracking and profiling."""

    best_metric_key: str = opt(
        None,
        "eval metric to keep the best policy by, higher is better (e.g. eval/pass@1; '' = eval/pass@1, 'none' = "
        "off): an eval that beats the best so far exports the actor to <ckpt_path>/best with best.json",
    )

    profile_steps: str = opt(
        None,
        "comma list of RL steps to trace with the torch profiler (driver and every rank; "
        "Chrome traces in <save_path>/profile/step<N>/)",
        metavar="A,B",
    )


@dataclass
class PromptDataConfig:
    """Prompts, labels, templates and lengths."""

    prompt_data: str = opt(None, "comma list of local prompt files / save_to_disk folders", metavar="PATHS")
    prompt_data_probs: str = opt(None, "sampling probabilities, one per --prompt_data source")
    input_key: str = opt("input", "column holding the prompt (string or chat messages)")
    label_key: str = opt(None, "column passed to the reward function as the label (e.g. the answer)")
    input_template: str = opt(None, "format string with one {} for the prompt")
    apply_chat_template: bool = opt(False, "render prompts with the tokenizer's chat template")
    disable_fast_tokenizer: bool = opt(False, "use the model's slow (Python) tokenizer where it has one")
    max_samples: int = opt(100_000_000, "use at most this many prompts")
    prompt_max_len: int = opt(
        1024, "longer prompts are dropped (counted in the log); an image prompt counts its images' tokens"
    )
    generate_max_len: int = opt(1024, "maximum new tokens per response")
    max_len: int = opt(
        None,
        "tokens per sample, prompt + response (OpenRLHF's total limit): a response may use what its prompt leaves "
        "of it, and at most --generate_max_len; prompts that leave no room are dropped. "
        "Default: --prompt_max_len + --generate_max_len",
    )
    image_key: str = opt(
        "images",
        "column holding each prompt's images, in the order of its {'type': 'image'} items: paths, data: URIs or "
        "base64 (docs/vlm.md); read when --max_images_per_prompt > 0",
    )
    max_images_per_prompt: int = opt(
        0, "images one prompt may carry (0: text only); rows with more are skipped and counted (docs/vlm.md)"
    )
    teacher_key: str = opt(
        None,
        "with several --teacher_pretrain: the column naming each prompt's teacher (its NAME, folder name or "
        "position from 0)",
    )
    tools_key: str = opt(
        None,
        "column holding each prompt's tools (OpenAI-format function schemas, a list or its JSON), which the chat "
        "template renders into the prompt (needs --apply_chat_template; an empty cell: none)",
    )
    eval_dataset: str = opt(None, "prompts for evaluation (pass@1 and pass@k with the reward source)", metavar="PATHS")
    prompt_split: str = opt("train", "split of --prompt_data sources that are save_to_disk DatasetDict folders")
    eval_split: str = opt("train", "split of --eval_dataset sources that are save_to_disk DatasetDict folders")
    eval_n_samples_per_prompt: int = opt(4, "samples per eval prompt (k of pass@k)")
    eval_temperature: float = opt(0.6, "sampling temperature at eval")
    eval_top_p: float = opt(None, "top-p at eval (default: --top_p); single-turn generation")
    eval_max_new_tokens: int = opt(
        None, "response tokens at eval, within what --max_len leaves (default: --generate_max_len); single-turn"
    )
    eval_batch_size: int = opt(None, "eval prompts generated at a time (default: all at once)")
    eval_at_start: bool = opt(
        False, "evaluate once before the first update, logged at step 0 (fresh runs only: a resumed run does not)"
    )
    eval_only: bool = opt(
        False,
        "evaluate the model (--pretrain, or the checkpoint --load_checkpoint resumes) on --eval_dataset, log it at "
        "its step, and stop: nothing is trained or exported. Of --pretrain only the engines (and a reward model) "
        "start, and only they must fit the cluster; a checkpoint's weights reach the engines through the actor, so "
        "its run's groups start",
    )

    def total_len(self) -> int:
        """The most tokens of one sample, prompt and response (the engines' context length)."""
        full = self.prompt_max_len + self.generate_max_len
        return full if self.max_len is None else min(self.max_len, full)

    def prompt_limit(self) -> int:
        """The longest prompt kept: one that leaves room for at least one response token."""
        return min(self.prompt_max_len, self.total_len() - 1)

    def response_budget(self, prompt_len: int) -> int:
        """New tokens a response to a prompt of `prompt_len` tokens may have."""
        return min(self.generate_max_len, self.total_len() - prompt_len)


@dataclass
class RolloutConfig:
    """Generation, batching and throughput options."""

    rollout_batch_size: int = opt(8, "prompts per RL step (each sampled --n_samples_per_prompt times)")
    n_samples_per_prompt: int = opt(1, "responses per prompt (the group size of group estimators)")
    micro_rollout_batch_size: int = opt(8, "samples per forward when scoring rollouts (log-probs, values)")
    temperature: float = opt(1.0, "sampling temperature (the trainer scores at the same temperature)")
    top_p: float = opt(
        1.0,
        "nucleus sampling: keep the most likely tokens up to this probability mass (the "
        "trainer recomputes the truncation for importance weights, docs/algorithms.md)",
    )
    top_k: int = opt(-1, "sample among the k most likely tokens; -1 = off (recomputed by the trainer as --top_p)")
    dynamic_filtering: bool = opt(
        False, "DAPO dynamic sampling: drop groups whose mean score is outside the range and refill with new prompts"
    )
    dynamic_filtering_reward_range: tuple[float, float] = opt((0.0, 1.0), "keep a group when lo < mean score < hi")
    packing_samples: bool = opt(
        False, "run each micro-batch as one packed row: no padding computed, no cross-sequence attention"
    )
    share_prompt_in_group: str = opt(
        "auto",
        "compute each group's prompt once in every forward and update, exactly (the n samples of a prompt share "
        "it); auto = on for group estimators with --packing_samples, --n_samples_per_prompt > 1 and sdpa attention "
        "(CPU: one sdpa call per response; GPU: FlexAttention)",
        choices=("auto", "on", "off"),
        const="on",
    )
    use_dynamic_batch: bool = opt(False, "fill micro-batches by a token budget instead of a sample count")
    train_max_tokens_per_gpu: int = opt(
        None,
        "token budget of a training micro-batch (--use_dynamic_batch); default: on GPUs the largest whose memory "
        f"plan leaves a fifth of a device free, at most {AUTO_TRAIN_TOKENS_MAX} (larger micro-batches move more "
        f"tokens a second; logged), {DEFAULT_TRAIN_TOKENS} on CPU. `python -m openppo.cli.plan` prints the plan",
    )
    rollout_max_tokens_per_gpu: int = opt(
        None, "token budget of a forward-only micro-batch; default: 2x the training budget"
    )
    ring_attn_size: int = opt(
        1, "ranks sharing each packed row (ring attention sequence parallelism; needs --packing_samples)"
    )
    ring_head_stride: int = opt(1, "KV heads sent per ring step (bounds the buffers); 0 = all at once")
    async_train: bool = opt(False, "generate the next batch while training on this one")
    async_queue_size: int = opt(1, "batches generated ahead (bound on policy staleness) with --async_train")
    force_sync_mode: bool = opt(
        False,
        "each batch is generated with the weights that then train on it: openppo's default; refused with "
        "--async_train, which generates ahead",
    )
    partial_rollout: bool = opt(
        False,
        "--async_train: a weight sync lands between two decoding steps of an unfinished generation, which keeps "
        "its tokens and goes on with the new weights; each token is tagged with the version that sampled it",
    )
    vllm_generate_batch_size: int = opt(
        None,
        "--async_train: prompts generated per round; above --rollout_batch_size the surplus groups wait for the "
        "next batches (oversampling: fewer rounds, staler samples); default: --rollout_batch_size",
    )
    agent_func_path: str = opt(
        None,
        "multi-turn agent: a .py file defining `Agent` (an openppo.agents.AgentEnv), or Molt's "
        "`AgentRunner` (a StepEnvRunner of a molt.agents.Env, run unchanged: docs/agents.md); its environment gives "
        "the reward, feedback tokens are masked out of the loss. A Molt ChatAgentRunner file runs as --agent_program",
        metavar="FILE",
    )
    agent_max_turns: int = opt(4, "most model turns per agent episode")
    agent_program: str = opt(
        None,
        "an agent that speaks the OpenAI (or Anthropic) API, served by the rollout engines through a local "
        "endpoint: FILE.py[:NAME] (a Python callable NAME(base_url, task), default name `agent`) or a command run once "
        "per episode (OPENAI_BASE_URL, ANTHROPIC_BASE_URL and OPENPPO_TASK in its environment); it returns the "
        "reward (a number; a command prints it last) or None for the reward function to score (docs/agents.md)",
        metavar="SPEC",
    )
    agent_timeout: float = opt(
        600.0,
        "seconds an --agent_program episode may take (a late one is dropped), or one step (or construction) of an "
        "--agent_func_path environment (a late one stops the run with an error naming it)",
    )
    agent_concurrency: int = opt(0, "--agent_program: episodes running at once (0: every episode of the batch)")
    agent_tool_parser: str = opt(
        None,
        "--agent_program: vLLM's tool-call parser for the model family (hermes for Qwen2.5/Qwen3, llama3_json, "
        "mistral, ...): replies carry OpenAI `tool_calls`; without it, tool calls stay in the text",
        metavar="NAME",
    )
    agent_host: str = opt("127.0.0.1", "--agent_program: the address the endpoint listens on (local by default)")

    @property
    def sampling(self) -> SamplingFilter:
        """The engine's truncation after the temperature, as the trainer recomputes it."""
        return SamplingFilter(top_k=self.top_k, top_p=self.top_p)

    def train_tokens(self) -> int:
        """A training micro-batch's token budget: --train_max_tokens_per_gpu, which the launch sizes to the GPUs
        when not given (`openppo.ppo.launch.resolve_token_budget`), else `DEFAULT_TRAIN_TOKENS`."""
        return self.train_max_tokens_per_gpu or DEFAULT_TRAIN_TOKENS

    def forward_tokens(self) -> int:
        """A forward-only micro-batch's token budget: no activations are kept for a backward, so 2x by default."""
        return self.rollout_max_tokens_per_gpu or 2 * self.train_tokens()


@dataclass
class PPOTrainConfig:
    """Optimisation of actor and critic."""

    train_batch_size: int = opt(8, "samples per optimizer step (all ranks)")
    micro_train_batch_size: int = opt(4, "samples per forward/backward on one rank")
    max_epochs: int = opt(1, "passes over each rollout batch")
    critic_max_epochs: int = opt(None, "the critic's passes over each rollout batch (default: --max_epochs)")
    force_on_policy: bool = opt(
        False,
        "one optimizer step per rollout batch, over all its rows whatever their number (an agent's sealed segments "
        "included), instead of --train_batch_size rows a step; needs --max_epochs 1",
    )
    num_episodes: int = opt(1, "passes over the prompt set")
    max_steps: int = opt(-1, "stop after this many RL steps; -1 = run all episodes")
    actor_learning_rate: float = opt(1e-6, "actor peak learning rate")
    critic_learning_rate: float = opt(9e-6, "critic peak learning rate")
    lr_warmup_ratio: float = opt(0.03, "share of optimizer steps spent warming up the LR")
    lr_scheduler: str = opt("cosine_with_min_lr", "LR schedule after warm-up", choices=LR_SCHEDULERS)
    min_lr_ratio: float = opt(0.1, "floor of cosine_with_min_lr as a share of the peak")
    max_norm: float = opt(1.0, "gradient clipping norm; 0 disables")
    freezing_actor_steps: int = opt(-1, "train only the critic for the first N steps (critic warm-up)")
    enable_ema: bool = opt(
        False,
        "keep an exponential moving average of the actor's weights (fp32, on the host) and export it instead "
        "of the trained weights: the final model, --save_hf_ckpt, --best_metric_key",
    )
    ema_beta: float = opt(0.992, "--enable_ema: e <- beta e + (1 - beta) w after each actor optimizer step")
    seed: int = opt(42, "random seed")
    rollout_dump_dir: str = opt(
        None,
        "save the batch that trains each step N to DIR/rollout_step{N}.pt, for --rollout_replay_dir",
        metavar="DIR",
    )
    rollout_replay_dir: str = opt(
        None,
        "train on the batches a --rollout_dump_dir run saved (DIR/rollout_step{N}.pt for step N) instead of "
        "generating, up to the first step without one; engines still start and take each update",
        metavar="DIR",
    )
    max_rank_restarts: int = opt(
        0,
        "when a rank of the actor, critic, reference or reward model dies (its process killed, its node lost), tear "
        "every group and engine down and start them again from the last committed checkpoint (--save_steps) in "
        "the same job, up to this many times; 0: stop the run instead",
    )
    full_determinism: bool = opt(
        False,
        "reseed the engines' sampling at every generation round from --seed and "
        "the prompt position, so a resumed run repeats the unbroken one step for "
        "step (fp32), and every eval alike (an eval of the same weights repeats), "
        "and run the trainer ranks with deterministic kernels only "
        "(transformers' enable_full_determinism: slower; an op without one raises); "
        "without it the engines' RNG restarts at a resume",
    )

    def step_rows(self, planned: int, rows: int) -> int:
        """Rows of a rank's optimizer step: the `planned` share of --train_batch_size, or all its `rows` of the batch
        with --force_on_policy (their number can differ from the plan's; at least 1, a step count's divisor)."""
        return max(rows, 1) if self.force_on_policy else planned

    def epochs(self, role: str) -> int:
        """Passes over each rollout batch of the trained `role` ("actor" or "critic")."""
        return self.critic_max_epochs if role == "critic" and self.critic_max_epochs is not None else self.max_epochs


@dataclass
class AlgoConfig:
    """Advantage estimator, losses, KL and reward shaping (formulas: docs/algorithms.md)."""

    advantage_estimator: str = opt(
        "gae",
        "gae = PPO with a critic; group_norm = GRPO; dr_grpo; rloo; "
        "reinforce; reinforce_baseline = REINFORCE++-baseline",
        choices=ADVANTAGE_ESTIMATORS,
    )
    init_kl_coef: float = opt(0.01, "KL coefficient beta; 0 = no reference model")
    kl_target: float = opt(
        None,
        "adaptive KL controller target in nats per response, the summed KL of one "
        "response (Ziegler et al.; None = fixed coefficient)",
    )
    kl_horizon: int = opt(10000, "adaptive KL controller horizon (samples)")
    use_kl_loss: bool = opt(False, "KL as a loss term (GRPO style) instead of a per-token reward penalty")
    kl_estimator: str = opt("k1", "KL estimator: k1 for the reward penalty, k2/k3 for the loss", choices=KL_ESTIMATORS)
    kl_unbiased_gradient: bool = opt(
        False,
        "--use_kl_loss: keep the estimator's value but backpropagate the reverse KL's unbiased gradient, "
        "(pi/pi_old) * (log pi - log pi_ref) * grad log pi (k3's own descends the forward KL; docs/algorithms.md)",
    )
    eps_clip: float = opt(0.2, "PPO clip range")
    eps_clip_low_high: tuple[float, float] = opt(None, "asymmetric clip (DAPO clip-higher), e.g. 0.2 0.28")
    dual_clip: float = opt(None, "dual-clip constant c > 1 for negative advantages")
    value_clip: float = opt(0.5, "critic value clip range")
    gamma: float = opt(1.0, "discount")
    lambd: float = opt(1.0, "GAE lambda (OpenRLHF default 1; PPO papers use 0.95)")
    entropy_loss_coef: float = opt(None, "entropy bonus weight (the entropy is logged either way)")
    normalize_reward: bool = opt(False, "normalise rewards with the mean/std stored in the reward model")
    reward_clip_range: tuple[float, float] = opt(
        (-10.0, 10.0), "clip rewards to this range (before the group baseline, see docs/algorithms.md)"
    )
    policy_loss_type: str = opt(
        "ppo",
        "ppo (token ratio), gspo (sequence ratio) or cispo (the token ratio clipped above at 1 + the clip's high "
        "value, as a stopped weight on the REINFORCE term; docs/algorithms.md)",
        choices=POLICY_LOSS_TYPES,
    )
    loss_agg_mode: str = opt(
        None, "loss aggregation; default per estimator (docs/algorithms.md)", choices=LOSS_AGG_MODES
    )
    no_advantage_std_norm: bool = opt(False, "global advantage normalisation only centres (no division by std)")
    no_advantage_whiten: bool = opt(
        False,
        "no global advantage normalisation at all: the returns (gae: returns - values) are the advantages, for the "
        "estimators that normalise by default (gae, reinforce, reinforce_baseline)",
    )
    overlong_buffer_len: int = opt(None, "DAPO overlong penalty buffer (tokens before --generate_max_len)")
    overlong_penalty_factor: float = opt(1.0, "DAPO overlong penalty at the end of the buffer")
    stop_properly_penalty_coef: float = opt(None, "truncated responses: reward x coef (0..1) or := coef (< 0)")
    distill_task_coef: float = opt(
        0.0,
        "with --teacher_pretrain: the advantage is log pi_teacher - log pi_student per token plus this times the "
        "task reward's advantage (--advantage_estimator); 0 = distillation alone, which needs no reward source",
    )


@dataclass
class PPOConfig:
    openrlhf_cli: ClassVar[str] = "train_ppo_ray"  # its OpenRLHF flags' other spellings (config.openrlhf_names)
    # --param_dtype auto is resolved on the cluster's devices once Ray is up (launch.resolve_run_precision), not by
    # the CLI runner on the driver's
    precision_on_cluster: ClassVar[bool] = True

    model: PPOModelConfig = field(default_factory=PPOModelConfig)
    resources: ResourceConfig = field(default_factory=ResourceConfig)
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    ds: PPODeepSpeedConfig = field(default_factory=PPODeepSpeedConfig)
    data: PromptDataConfig = field(default_factory=PromptDataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: PPOTrainConfig = field(default_factory=PPOTrainConfig)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    ckpt: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: PPOLoggingConfig = field(default_factory=PPOLoggingConfig)


def engines_colocated(cfg: PPOConfig) -> bool:
    """Whether the vLLM engines share the actor's devices (the hybrid engine): --colocate_all_models, unless
    --async_train, which generates while the trainer works, so that the flag colocates the DeepSpeed models only.
    That is OpenRLHF's rule, and its async agent recipe gives both flags."""
    return cfg.resources.colocate_all_models and not cfg.rollout.async_train


def ranks_per_shard(cfg: PPOConfig, role: str) -> int:
    """How many consecutive ranks of a role's group hold the same rows: a ring (--ring_attn_size) splits each row's
    tokens over its ranks, a tensor-parallel group (--ds_tensor_parallel_size, actor only) splits the weights."""
    return cfg.rollout.ring_attn_size * (cfg.ds.ds_tensor_parallel_size if role == "actor" else 1)
