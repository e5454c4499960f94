"""Building a PPO run: data and reward source (validated before Ray starts), worker groups, engines."""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from typing import Any

import datasets
import torch

from openppo.agents.program import AgentProgram
from openppo.datasets import PromptDataset, load_blended_dataset, require_columns
from openppo.ppo.collector import RolloutSource, Scorer
from openppo.ppo.colocation import EnginePlacement, colocation_pools, engine_placement
from openppo.ppo.config import PPOConfig, engines_colocated
from openppo.ppo.groups import Groups
from openppo.ppo.plan import RunPlan
from openppo.ppo.validate import check_reward_normalization, role_ranks, used_roles
from openppo.utils.hardware import Bf16Support

logger = logging.getLogger(__name__)

MAX_CONCURRENT_SEQUENCES = 256  # vLLM schedules at most this many sequences at once by default (max_num_seqs)


def load_prompt_rows(cfg: PPOConfig, *, eval: bool = False) -> datasets.Dataset:
    """The training rows, or with `eval=True` the whole `--eval_dataset`, with --input_key/--label_key checked.

    Needs no tokenizer, so a wrong path, an empty file or a wrong key fails before the tokenizer loads."""
    d = cfg.data
    if eval:
        raw = load_blended_dataset(
            d.eval_dataset,
            None,
            flag="--eval_dataset",
            probs_flag="--eval_dataset",
            seed=cfg.train.seed,
            max_samples=None,
            split=d.eval_split,
            split_flag="--eval_split",
        )
    else:
        raw = load_blended_dataset(
            d.prompt_data,
            d.prompt_data_probs,
            flag="--prompt_data",
            probs_flag="--prompt_data_probs",
            seed=cfg.train.seed,
            max_samples=d.max_samples,
            split=d.prompt_split,
            split_flag="--prompt_split",
        )
    keys = {"--input_key": d.input_key, "--label_key": d.label_key}
    if not eval and len(cfg.model.teacher_pretrain) > 1:
        keys["--teacher_key"] = d.teacher_key
    require_columns(raw, keys, d.eval_dataset if eval else d.prompt_data)
    return raw


def teacher_routes(cfg: PPOConfig, raw: datasets.Dataset) -> list[int] | None:
    """Each training row's teacher (`teachers.route`; None with one teacher or none)."""
    from openppo.ppo.teachers import parse_teachers, route

    teachers, key = parse_teachers(cfg.model.teacher_pretrain), cfg.data.teacher_key
    if len(teachers) < 2:
        return None
    return route(raw[key] if key else None, teachers, key)


def critic_export_dir(cfg: PPOConfig) -> str | None:
    """--save_value_network: where the trained critic's HF folder goes, OpenRLHF's `<save_path>_critic`."""
    return f"{str(cfg.ckpt.save_path).rstrip('/')}_critic" if cfg.model.save_value_network else None


@functools.cache
def image_processor(pretrain: str):
    """The vision-language model's processor, loaded once for the run's prompts, eval prompts and agent episodes."""
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(pretrain, trust_remote_code=True)


def load_prompts(cfg: PPOConfig, tokenizer, raw: datasets.Dataset, keep_messages: bool = False) -> PromptDataset:
    """Rows of `load_prompt_rows` rendered and tokenized (prompts longer than --prompt_max_len dropped);
    `keep_messages`: each item also holds its prompt as unrendered chat messages and its tools (an agent program's
    task)."""
    d = cfg.data
    # the image prompts' chat template is the processor's (docs/vlm.md)
    processor = image_processor(cfg.model.pretrain) if d.max_images_per_prompt > 0 else None
    return PromptDataset(
        raw,
        tokenizer,
        input_key=d.input_key,
        label_key=d.label_key,
        apply_chat_template=d.apply_chat_template,
        input_template=d.input_template,
        max_prompt_len=d.prompt_limit(),
        image_key=d.image_key,
        max_images=d.max_images_per_prompt,
        processor=processor,
        tools_key=d.tools_key,
        keep_messages=keep_messages,
    )


def rollout_parts(
    cfg: PPOConfig, groups: Groups, tokenizer, agent_episodes=None, agent_program=None
) -> tuple[RolloutSource, Scorer]:
    """The run's rollout source and scorer, chosen once: the agent's episodes for both (`agent_episodes(cfg,
    tokenizer)`, built before Ray starts so that a broken agent file fails first), or an --agent_program's episodes
    through the endpoint (`load_agent_program`, also loaded first; scored by the agent, else as single turns are), or
    single-turn generation scored by the reward source (--remote_rm_url), else the reward model's ranks, else (a
    teacher's distillation alone) by no one: every reward 0."""
    from openppo.ppo.collector import AgentEpisodes, NoReward, SingleTurn, TextRewards
    from openppo.ppo.served_agents import ServedAgents

    single = SingleTurn(groups.engines, cfg)
    if agent_episodes is not None:
        agent = AgentEpisodes(single, agent_episodes)
        return agent, agent
    if groups.reward_source is not None:
        scorer = TextRewards(groups.reward_source, tokenizer)
    elif groups.reward is not None:
        groups.reward.pad_token_id = tokenizer.pad_token_id
        scorer = groups.reward
    else:  # validation allows it with teachers only (distillation alone), or an agent that returns rewards
        scorer = None
    if agent_program is not None:
        served = ServedAgents(single, agent_program, tokenizer, scorer)
        return served, served
    return single, scorer or NoReward()


def load_agent(cfg: PPOConfig, tokenizer) -> tuple[Any, AgentProgram | None]:
    """The run's agent, loaded before Ray starts so that a broken file fails first: (`agent_episodes`, None) for an
    --agent_func_path environment, (None, the program) for an --agent_program or a Molt chat agent (a file whose
    `AgentRunner` is a `ChatAgentRunner`, given as --agent_func_path / Molt's --train.agent_path: it calls the
    policy through the endpoint, as an --agent_program does), (None, None) without an agent."""
    from openppo.agents import load_agent as load_agent_file
    from openppo.agents import molt
    from openppo.agents.program import load_agent_program

    r, d = cfg.rollout, cfg.data
    if r.agent_program:
        return None, load_agent_program(r.agent_program)
    if not r.agent_func_path:
        return None, None
    agent = load_agent_file(r.agent_func_path)
    if isinstance(agent, type):
        # (OpenRLHF's executor plays an episode until it is done or out of room: no cap on its turns to mirror)
        logger.info(
            "--agent_func_path %s: %s, at most %d model turns an episode (--agent_max_turns)",
            r.agent_func_path,
            agent.__name__,
            r.agent_max_turns,
        )
        return agent_episodes(cfg, tokenizer, agent), None
    settings = molt.ChatSettings(
        model_name=cfg.model.pretrain,
        max_tokens=d.generate_max_len,
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        max_length=d.total_len(),
    )
    logger.info("--agent_func_path %s: a Molt ChatAgent, played through the run's endpoint", r.agent_func_path)
    return None, molt.chat_program(agent, r.agent_func_path, settings)


def agent_episodes(cfg: PPOConfig, tokenizer, env_cls):
    """`(generate, items, n) -> samples` running the `--agent_func_path` environment `env_cls`'s episodes.

    Each model turn may use up to --generate_max_len new tokens; prompt, every turn and the environment's feedback
    together stay within the engines' context length (--max_len, default --prompt_max_len + --generate_max_len).
    """
    from openppo.agents import run_agent_episodes

    d = cfg.data
    placeholders: list[int] = []
    expand_images = None
    if d.max_images_per_prompt > 0:
        from transformers import AutoConfig

        from openppo.models.vision import image_placeholder_ids
        from openppo.utils.images import open_image

        # a turn that samples the placeholder ends its episode; feedback with images is expanded as the engines
        # expand it, by the model's processor
        placeholders = image_placeholder_ids(AutoConfig.from_pretrained(cfg.model.pretrain, trust_remote_code=True))
        processor = image_processor(cfg.model.pretrain)

        def expand_images(text: str, images: list) -> list[int]:
            opened = [open_image(image) for image in images]
            return list(processor(text=text, images=opened, add_special_tokens=False)["input_ids"][0])

    def rollout(generate, items, n):
        return run_agent_episodes(
            generate,
            tokenizer,
            items,
            n_samples_per_prompt=n,
            env_cls=env_cls,
            max_turns=cfg.rollout.agent_max_turns,
            max_new_tokens=d.generate_max_len,
            max_total_len=d.total_len(),
            env_timeout_s=cfg.rollout.agent_timeout,
            image_placeholders=placeholders,
            expand_images=expand_images,
            max_images=d.max_images_per_prompt,
        )

    return rollout


@dataclass(frozen=True)
class ClusterDevices:
    """The devices of the Ray cluster the run uses: its nodes' GPUs when it has any, else their CPUs. Not the
    driver's: under `ray job submit` the driver may sit on a head node without GPUs."""

    on_gpu: bool
    count: int  # GPUs, or (logical) CPUs
    local: bool  # every node is this machine and sees the same device kind as this process
    nodes: tuple[tuple[str, int], ...] = ()  # (address, devices) of each node

    def describe(self) -> str:
        where = "this machine" if self.local else "the cluster"
        return f"devices: {self.count} {'GPU' if self.on_gpu else 'CPU'}(s) on {where} (Ray's resources)"


def run_devices() -> ClusterDevices:
    """The run's devices, before anything starts: joining a cluster (RAY_ADDRESS, as under `ray job submit`) connects
    to it and asks it (`cluster_devices`); a run on its own starts a cluster of this machine later, whose devices are
    this machine's, so none is started yet (a bad flag still fails before anything is launched)."""
    if os.environ.get("RAY_ADDRESS"):
        start_ray()
        return cluster_devices()
    on_gpu = torch.cuda.is_available()
    count = torch.cuda.device_count() if on_gpu else local_cpu_slots()
    return ClusterDevices(on_gpu, count, True, (("this machine", count),))


def cluster_devices() -> ClusterDevices:
    """What the connected cluster offers (`placement.device_resources`); call after `start_ray`."""
    import ray

    from openppo.distributed.placement import device_resources

    on_gpu, count = device_resources()
    here = ray.util.get_node_ip_address()
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    local = all(n["NodeManagerAddress"] == here for n in nodes) and on_gpu == torch.cuda.is_available()
    kind = "GPU" if on_gpu else "CPU"
    per_node = tuple((n["NodeManagerAddress"], int(n["Resources"].get(kind, 0))) for n in nodes)
    return ClusterDevices(on_gpu, count, local, per_node)


@dataclass(frozen=True)
class DeviceProbe:
    """What one trainer rank's device is, probed before anything starts."""

    support: Bf16Support
    memory_bytes: int | None  # one GPU's memory (`gpu_memory_bytes`); None on CPU


def probe_devices(cfg: PPOConfig, devices: ClusterDevices) -> DeviceProbe:
    """The trainer ranks' device, probed in this process when it is this machine's, else by one Ray task with a
    trainer rank's resources."""
    if devices.local:
        return _device_probe()
    import ray

    probe = ray.remote(num_cpus=1, num_gpus=1 if devices.on_gpu else 0)(_device_probe)
    return ray.get(probe.remote(), timeout=float(cfg.ds.dist_timeout))


def resolve_run_precision(cfg: PPOConfig, probe: DeviceProbe) -> str:
    """`--param_dtype auto` (and the bf16 speed warning) decided on the devices the trainer ranks get
    (`probe_devices`). Logged in one line."""
    from openppo.utils.hardware import resolve_param_dtype

    dtype, info, warning = resolve_param_dtype(cfg.ds.param_dtype, probe.support)
    for line, log in ((info, logger.info), (warning, logger.warning)):
        if line:
            log(line)
    cfg.ds.param_dtype = dtype
    return dtype


def resolve_token_budget(cfg: PPOConfig, probe: DeviceProbe, on_gpu: bool) -> int:
    """--train_max_tokens_per_gpu when not given, sized to the trainer ranks' GPUs with --use_dynamic_batch
    (`memory_plan.default_token_budget`), logged in one line; after `resolve_run_precision`, since the plan counts in
    the run's dtype."""
    from openppo.ppo.memory_plan import default_token_budget

    tokens, line = default_token_budget(cfg, probe.memory_bytes, on_gpu)
    if line:
        logger.info(line)
    cfg.rollout.train_max_tokens_per_gpu = tokens
    return tokens


def resolve_attention(cfg: PPOConfig, devices: ClusterDevices) -> None:
    """--attn_implementation flash_attention_2 on a cluster of CPUs is sdpa (as `openppo.models.hf.attention_kernel`
    loads it in each rank), decided once here so that what depends on the kernel (shared prompts) sees the one the
    ranks load. On GPUs each rank decides: whether flash-attn is installed is the nodes' business."""
    if not devices.on_gpu and cfg.model.attn_implementation == "flash_attention_2":
        logger.info(
            "note: --attn_implementation flash_attention_2 needs CUDA devices: sdpa instead (the same attention)"
        )
        cfg.model.attn_implementation = "sdpa"


def started_roles(plan: RunPlan, eval_only: bool) -> dict:
    """The model groups a run starts (role -> `plan.roles`' entry): every one, or with `eval_only`
    (`evaluates_pretrain`) the reward model alone, beside the engines."""
    return {name: role for name, role in plan.roles.items() if not eval_only or name == "reward"}


def check_layout_fits(cfg: PPOConfig, plan: RunPlan, devices: ClusterDevices, *, eval_only: bool = False) -> None:
    """Refuse, in one line naming the flags, a layout the cluster cannot place: more devices than it has (counted
    as `colocation.device_demand` asks for them); a placement group that --placement_strategy STRICT_SPREAD or
    STRICT_PACK cannot place on the nodes there are (named, with their devices); or, on GPUs, an engine of its own
    whose tensor-parallel workers need more GPUs than any one node has. (Ray would otherwise wait for resources that
    never come.) `eval_only`: the groups that run starts (`started_roles`), not the training layout."""
    from openppo.distributed.placement import strategy_fits
    from openppo.errors import UserError
    from openppo.ppo.colocation import device_demand

    kind = "GPU" if devices.on_gpu else "CPU slot"
    demand = device_demand(
        cfg, {name: role.ranks for name, role in started_roles(plan, eval_only).items()}, devices.on_gpu
    )
    total = sum(d.count for d in demand)
    if total > devices.count:
        parts = ", ".join(f"{d.what} {d.count}" for d in demand)
        raise UserError(
            f"the run needs {total} {kind}s and the cluster has {devices.count}: {parts}; share devices "
            f"(--colocate_all_models, --colocate_actor_ref, --colocate_critic_reward), use fewer ranks or engines, or "
            f"add nodes"
        )
    strategy = cfg.resources.placement_strategy
    per_node = [count for _, count in devices.nodes]
    for d in demand:
        if d.placement_group and not strategy_fits(strategy, d.count, per_node):
            where = "each on a node of its own" if strategy == "STRICT_SPREAD" else "all on one node"
            nodes = ", ".join(f"{address} {count}" for address, count in devices.nodes)
            raise UserError(
                f"--placement_strategy {strategy}: {d.what} needs {d.count} {kind}s {where}, and the cluster's "
                f"nodes have {nodes} {kind}s; use --placement_strategy PACK or SPREAD, fewer ranks, or more nodes"
            )
    if strategy != "PACK" and len(devices.nodes) == 1:
        logger.info(
            "--placement_strategy %s has no effect: the cluster has one node, which holds every group", strategy
        )
    tp = cfg.vllm.vllm_tensor_parallel_size
    if devices.on_gpu and not engines_colocated(cfg) and tp > 1:
        most = max(per_node, default=devices.count)
        if most < tp:
            raise UserError(
                f"--vllm_tensor_parallel_size {tp}: an engine's workers share one node, and no node of the cluster "
                f"has more than {most} GPUs; use a smaller --vllm_tensor_parallel_size or nodes with more GPUs"
            )


def _device_probe() -> DeviceProbe:
    from openppo.utils.hardware import bf16_support, gpu_memory_bytes

    return DeviceProbe(bf16_support(), gpu_memory_bytes())


def kv_cache_bytes(cfg: PPOConfig, on_gpu: bool, *, eval_only: bool = False) -> int | None:
    """Each engine worker's KV cache in bytes: --vllm_kv_cache_bytes when given; on GPU otherwise None (vLLM sizes
    it from --vllm_gpu_memory_utilization); on CPU sized from the rollouts the run generates and capped by the RAM
    its other processes leave (`memory_plan.cpu_kv_cache_bytes`, logged in one line): with `eval_only`
    (`evaluates_pretrain`) the engines' and a reward model's only. Call before the model groups start loading, so
    that the free RAM it reads is not already taken by them."""
    import psutil

    from openppo.ppo.memory_plan import cpu_kv_cache_bytes, dtype_bytes, host_bytes_of_trainers, run_shapes

    v, r = cfg.vllm, cfg.rollout
    if v.vllm_kv_cache_bytes or on_gpu:
        return v.vllm_kv_cache_bytes
    shapes = run_shapes(cfg)
    tp = v.vllm_tensor_parallel_size
    # a tensor-parallel worker caches its share of the KV heads (whole heads: a head is never split)
    actor = shapes["actor"]
    per_token = actor.kv_bytes_per_token(dtype_bytes(cfg.ds.param_dtype)) // min(tp, actor.kv_heads)
    samples = r.rollout_batch_size * r.n_samples_per_prompt
    size = cpu_kv_cache_bytes(
        per_token=per_token,
        sequences=min(MAX_CONCURRENT_SEQUENCES, -(-samples // v.vllm_num_engines)),
        max_model_len=cfg.data.total_len(),
        available=psutil.virtual_memory().available,
        others=host_bytes_of_trainers(cfg, shapes, eval_only=eval_only),
        share=v.vllm_gpu_memory_utilization,
        engines=v.vllm_num_engines * tp,
    )
    logger.info(size.reason)
    return size.bytes


def cpu_threads_per_process(cfg: PPOConfig, on_gpu: bool, *, eval_only: bool = False) -> int:
    """Threads for each worker and engine. A synchronous step's stages run one after another: the engines generate
    side by side, then a model group's ranks work side by side (the actor's train; the reference's, critic's, reward
    model's or a teacher's score), so the largest of those groups splits the cores; with --async_train the engines
    generate while the trainer works, so the engines and the largest group split them. `eval_only`
    (`evaluates_pretrain`): the engines and the reward model. Two engines that each had a 2-core box's two threads
    generated 6.4x slower than with one each, their threads waiting on each other (docs/benchmarks.md,
    `bench/engine_threads.py`). On GPU machines the CPU threads matter little."""
    if "OMP_NUM_THREADS" in os.environ:
        return int(os.environ["OMP_NUM_THREADS"])
    if on_gpu:
        return 4
    engines = cfg.vllm.vllm_num_engines
    if eval_only:  # the reward model scores what the engines generated
        busy = max(role_ranks(cfg, "reward") if cfg.model.reward_pretrain else 0, engines)
    else:
        group = max(role_ranks(cfg, role) for role in used_roles(cfg))
        busy = group + engines if cfg.rollout.async_train else max(group, engines)
    return max(1, (os.cpu_count() or 1) // max(1, busy))


def start_ray() -> None:
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    runtime_env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false", "RAY_AUTH_MODE": "disabled"}}
    if os.environ.get("RAY_ADDRESS"):
        # `ray job submit` (or an explicit RAY_ADDRESS): join that cluster, whose nodes hold the devices.
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True, runtime_env=runtime_env)
        return
    # Otherwise always start our own one-node cluster; never attach to another job's on this machine.
    kwargs: dict[str, Any] = {
        "address": "local",
        "include_dashboard": False,
        "log_to_driver": True,
        "runtime_env": runtime_env,
    }
    if not torch.cuda.is_available():
        kwargs["num_cpus"] = local_cpu_slots()
    ray.init(**kwargs)


def local_cpu_slots() -> int:
    """Ray's CPUs in the cluster a CPU run starts on this machine: logical slots for placement, not cores (threads
    are budgeted per worker)."""
    return max(16, os.cpu_count() or 1)


def evaluates_pretrain(cfg: PPOConfig) -> bool:
    """--eval_only of --pretrain (no --load_checkpoint, or no checkpoint yet): the engines load it themselves, so the
    trained groups need not start. Evaluating a checkpoint needs them: its weights reach the engines through the
    actor."""
    from openppo.strategy import checkpoint

    return cfg.data.eval_only and not (
        cfg.ckpt.load_checkpoint and checkpoint.resolve(cfg.ckpt.checkpoint_dir()) is not None
    )


def build_groups(
    cfg: PPOConfig, plan: RunPlan, reward_source, kv_bytes: int | None, on_gpu: bool, *, eval_only: bool = False
) -> Groups:
    """Start every model group and the engines; `kv_bytes` is each engine worker's KV cache (`kv_cache_bytes`),
    `on_gpu` whether the cluster's devices are GPUs (`cluster_devices`). `eval_only` (`evaluates_pretrain`): the
    engines and the reward model only, the engines serving --pretrain as loaded (no actor: no weight sync)."""
    import ray

    from openppo.distributed.logs import actor_infos
    from openppo.distributed.placement import describe_nodes
    from openppo.distributed.worker_group import WorkerGroup
    from openppo.ppo.groups import ActorGroup, CriticGroup, ReferenceGroup, RewardGroup, TeacherGroup
    from openppo.ppo.workers import ActorWorker, CriticWorker, ReferenceWorker, RewardWorker, TeacherWorker
    from openppo.rollout import VLLMEngine
    from openppo.rollout.pool import EnginePool

    timeout = float(cfg.ds.dist_timeout)
    env = {"OMP_NUM_THREADS": str(cpu_threads_per_process(cfg, on_gpu, eval_only=eval_only))}
    gpu = 1.0 if on_gpu else 0.0
    roles = started_roles(plan, eval_only)
    shared = shared_placement_groups(cfg, set(roles), on_gpu, timeout)
    # Everything is asked for before anything is waited for, the engines first (the longest start: vLLM's client,
    # then its engine core process, each importing vLLM): the groups' processes start and load side by side.
    engine_cls = ray.remote(VLLMEngine)

    def start_engine(i: int):
        """Engine i's actor: also what replaces it when it dies (`EnginePool.replace`), on the same resources."""
        options, place = engine_options(cfg, i, shared, env, on_gpu)
        return engine_cls.options(**options).remote(
            cfg.model.pretrain,
            dtype=plan.engine_dtype,
            seed=cfg.train.seed + i,
            max_model_len=cfg.data.total_len(),
            enforce_eager=cfg.vllm.enforce_eager or not on_gpu,
            enable_prefix_caching=cfg.vllm.enable_prefix_caching,
            gpu_memory_utilization=cfg.vllm.vllm_gpu_memory_utilization,
            kv_cache_bytes=kv_bytes,
            tensor_parallel_size=cfg.vllm.vllm_tensor_parallel_size,
            enable_sleep=cfg.vllm.vllm_enable_sleep,
            executor=place.executor,
            partial_rollout=cfg.rollout.partial_rollout,
            max_images_per_prompt=cfg.data.max_images_per_prompt,
            engine_args=cfg.vllm.engine_args(on_gpu),
        )

    engines = [start_engine(i) for i in range(cfg.vllm.vllm_num_engines)]
    handles = {
        "actor": (ActorGroup, ActorWorker),
        "reference": (ReferenceGroup, ReferenceWorker),
        "critic": (CriticGroup, CriticWorker),
        "reward": (RewardGroup, RewardWorker),
    }
    handles.update({name: (TeacherGroup, TeacherWorker) for name in roles if name.startswith("teacher")})
    launched = {}
    for name, role in roles.items():
        pg, share = shared.get(name, (None, 1.0))
        launched[name] = WorkerGroup(
            handles[name][1],
            role.ranks,
            placement_group=pg,
            strategy=cfg.resources.placement_strategy,
            num_cpus_per_worker=share,
            num_gpus_per_worker=gpu * share,
            env=env,
            name=name,
            timeout_s=timeout,
            wait=False,
        )
    started = {}
    for name, workers in launched.items():  # each group's `setup` starts once its ranks are up (models load)
        workers.connect()
        role = roles[name]
        group = handles[name][0](workers, replicas=role.replicas, balance=plan.balance, share=role.share_prompts)
        started[name] = (group, workers.run_async(handles[name][1].setup, cfg, role))
    groups = {name: group for name, (group, _) in started.items()}
    ray.get([e.ready.remote() for e in engines], timeout=timeout)
    pool = EnginePool(
        engines,
        actor_infos(engines, timeout),
        timeout_s=timeout,
        partial=cfg.rollout.partial_rollout,
        start=start_engine,
        max_restarts=cfg.vllm.max_engine_restarts,
    )
    for i, info in enumerate(pool.infos):
        logger.info("vLLM engine %d: pid %s on %s (actor %s)", i, info["pid"], info["node_ip"], info["actor_id"])
    for name, group in groups.items():  # (what a failure report names, and what an operator kills to test one)
        where = ", ".join(f"{r} pid {i['pid']} on {i['node_ip']}" for r, i in enumerate(group.workers.worker_infos))
        logger.info("%s ranks: %s", name, where)
    nodes = {name: [info["node_ip"] for info in group.workers.worker_infos] for name, group in groups.items()}
    nodes["engines"] = [info["node_ip"] for info in pool.infos]
    logger.info("placement (%s): %s", cfg.resources.placement_strategy, describe_nodes(nodes))
    results = {name: group.workers.get(setups) for name, (group, setups) in started.items()}
    if "reward" in groups:
        groups["reward"].normalization = check_reward_normalization(cfg, results["reward"][0])
    actor = groups.get("actor")
    link = None
    if actor is not None:
        link = EngineLink(cfg, actor, pool, plan.engine_dtype, on_gpu)
        link.connect()
    return Groups(
        actor=actor,
        engines=pool,
        critic=groups.get("critic"),
        reference=groups.get("reference"),
        reward=groups.get("reward"),
        reward_source=reward_source,
        link=link,
        placement_groups=list({id(pg): pg for pg, _ in shared.values()}.values()),
        teachers=[groups[name] for name in roles if name.startswith("teacher")],
    )


class EngineLink:
    """How the actor ranks reach the engines for the weight sync: the sync plan (`sync_plan`) and, for engines on
    devices of their own, the broadcast group. Made at start-up, and made anew once a dead engine was replaced
    (`ensure`, when the pool's `epoch` moved): the new engine's workers may sit elsewhere, and a broadcast group's
    size is fixed when it forms."""

    def __init__(self, cfg: PPOConfig, actor, pool, engine_dtype: str, on_gpu: bool):
        self.cfg, self.actor, self.pool, self.engine_dtype, self.on_gpu = cfg, actor, pool, engine_dtype, on_gpu
        self.backend = "nccl" if on_gpu and cfg.vllm.vllm_sync_backend == "nccl" else "gloo"
        self.epoch = -1  # the pool's epoch at the last connect

    def connect(self) -> None:
        import ray

        v, pool = self.cfg.vllm, self.pool
        with pool.lock:
            workers = ray.get([e.worker_locations.remote() for e in pool.engines], timeout=pool.timeout_s)
            transports = sync_plan(self.cfg, self.actor.worker_infos, workers, self.backend, on_gpu=self.on_gpu)
            self.actor.connect_engines(
                pool,
                transports,
                self.backend,
                v.vllm_tensor_parallel_size,
                bucket_bytes=v.vllm_sync_bucket_mb * 2**20,
                engine_dtype=self.engine_dtype,
                delta=v.vllm_sync_delta,
            )
            self.epoch = pool.epoch

    def ensure(self) -> None:
        """Connect anew if an engine was replaced since the last connect (call under the pool's lock)."""
        if self.epoch != self.pool.epoch:
            self.connect()


def shared_placement_groups(cfg: PPOConfig, roles: set[str], on_gpu: bool, timeout_s: float) -> dict[str, tuple]:
    """{role: (placement group, share of each of its bundles)} for the roles that share devices
    (`colocation.colocation_pools`: "engines" among them in the hybrid engine); each pool's group is made (and
    waited for, at most `timeout_s`) here, one bundle of {CPU: 1, GPU: 1 on GPUs} per device."""
    from openppo.distributed.placement import make_placement_group

    shared = {}
    for pool in colocation_pools(cfg, roles | {"engines"}):
        pg = make_placement_group(
            pool.bundles,
            cpus_per_bundle=1.0,
            gpus_per_bundle=float(on_gpu),
            strategy=cfg.resources.placement_strategy,
            timeout_s=timeout_s,
            name=f"{pool.name}-pg",
        )
        shared.update({role: (pg, pool.fraction) for role in pool.members})
        logger.info("colocated (%s): %s", pool.name, pool.describe())
    return shared


def engine_options(
    cfg: PPOConfig, index: int, shared: dict[str, tuple], env: dict[str, str], on_gpu: bool
) -> tuple[dict, EnginePlacement]:
    """The Ray options of engine `index`'s actor, and its `colocation.engine_placement`: its resources, its
    environment, and in the hybrid engine the bundle of actor rank index*tp that it and vLLM's workers are placed on."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    pg, share = shared.get("engines", (None, None))
    place = engine_placement(cfg, index, on_gpu=on_gpu, hybrid_share=share)
    options: dict[str, Any] = {
        "runtime_env": {"env_vars": {**env, **dict(place.env)}},
        "num_cpus": place.num_cpus,
        "num_gpus": place.num_gpus,
    }
    if place.bundles is not None:  # hybrid engine: its workers on the devices of actor ranks i*tp .. i*tp+tp-1
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            pg, placement_group_bundle_index=place.bundles[0], placement_group_capture_child_tasks=True
        )
    elif cfg.resources.placement_strategy in ("SPREAD", "STRICT_SPREAD"):
        options["scheduling_strategy"] = "SPREAD"  # Ray spreads actors on a best-effort basis only
    return options, place


def sync_plan(cfg: PPOConfig, rank_infos: list[dict], engine_workers: list[list[dict]], backend: str, *, on_gpu: bool):
    """How each engine gets the weights (a `openppo.rollout.transport.SyncPlan`), from where the actor ranks and each
    engine's workers report they compute (`VLLMEngine.worker_locations`: vLLM, not openppo, picks a tensor-parallel
    worker's GPU among its engine's), logged in one line. A hybrid-engine worker on no actor rank's device, or a
    broadcast group that would hold two processes of one GPU, is refused here, before the first sync."""
    from openppo.errors import UserError
    from openppo.rollout.transport import (
        BROADCAST,
        LOCAL,
        OBJECT_STORE,
        Where,
        check_broadcast_group,
        choose_transports,
        describe,
    )

    ranks = [Where.of(info) for info in rank_infos]
    workers = [[Where.of(w) for w in locations] for locations in engine_workers]
    colocated = engines_colocated(cfg)
    plan = choose_transports(
        ranks,
        workers,
        colocated=colocated,
        on_gpu=on_gpu,
        remote=OBJECT_STORE if cfg.vllm.vllm_sync_with_ray else BROADCAST,
    )
    for i, (transport, sources) in enumerate(zip(plan.transports, plan.sources)):
        if colocated and transport not in LOCAL:
            where = ", ".join(f"worker {w} on {x.describe()}" for w, x in enumerate(workers[i]))
            raise UserError(
                f"--colocate_all_models: vLLM engine {i} has a worker on no actor rank's device ({where}; actor ranks: "
                f"{', '.join(r.describe() for r in ranks)}); its weights would need a broadcast group beside the "
                f"trainer on one GPU. Check --vllm_num_engines x --vllm_tensor_parallel_size against the actor ranks"
            )
        if transport in LOCAL:
            fed = ", ".join(
                f"worker {w} on {x.describe()} <- actor rank {r}" for w, (x, r) in enumerate(zip(workers[i], sources))
            )
            logger.info("vLLM engine %d: %s", i, fed)
    check_broadcast_group(
        [("actor rank 0", ranks[0])]
        + [
            (f"vLLM engine {i}", where) for i, t in enumerate(plan.transports) if t == BROADCAST for where in workers[i]
        ],
        backend,
    )
    logger.info(describe(plan, backend))
    return plan


def raise_if_an_engine_died(groups: Groups | None, error: BaseException) -> None:
    """After `error` stopped the run: if a vLLM engine is dead, raise the error naming it (the root cause)."""
    from openppo.distributed.logs import ActorDiedError, find_dead

    if isinstance(error, ActorDiedError):  # the engine pool named it already (past --max_engine_restarts)
        return
    if groups is not None and len(groups.engines):
        dead = find_dead(groups.engines.engines, groups.engines.infos, "vLLM engine")
        if dead is not None:
            raise dead from error


def teardown(groups: Groups | None) -> None:
    """Stop the engines' vLLM processes, kill every group's ranks and engine actors, and free the shared placement
    groups: what a restart from the checkpoint (--max_rank_restarts) starts again. Ray stays up."""
    import ray
    from ray.util.placement_group import remove_placement_group

    if groups is None:
        return
    groups.engines.shutdown()
    for engine in groups.engines.engines:
        try:
            ray.kill(engine, no_restart=True)
        except Exception as e:  # gone already
            logger.debug("killing a vLLM engine failed: %s", e)
    for g in groups.models():
        g.shutdown()
    for pg in groups.placement_groups:
        try:
            remove_placement_group(pg)
        except Exception as e:
            logger.debug("removing a placement group failed: %s", e)


def restartable(cfg: PPOConfig, error: BaseException, restarts: int) -> bool:
    """Whether `error` is a rank that died (not one that raised or hung: that would most likely happen again) and
    --max_rank_restarts leaves a restart from the checkpoint."""
    from openppo.distributed.worker_group import WorkerGroupError

    return isinstance(error, WorkerGroupError) and error.died and restarts < cfg.train.max_rank_restarts


def shutdown(groups: Groups | None) -> None:
    import ray

    teardown(groups)
    if ray.is_initialized():
        ray.shutdown()
