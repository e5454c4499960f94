"""Building a PPO run: data and reward source (validated before Ray starts), worker groups, engines."""

from __future__ import annotations

import logging
import os
from typing import Any

import datasets
import torch

from openppo.datasets import PromptDataset, load_blended_dataset, require_columns
from openppo.ppo.collector import RolloutSource, Scorer
from openppo.ppo.colocation import colocation_pools, engine_placement
from openppo.ppo.config import PPOConfig
from openppo.ppo.groups import Groups
from openppo.ppo.plan import RunPlan
from openppo.ppo.validate import actor_world_size, check_reward_normalization

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
    require_columns(
        raw, {"--input_key": d.input_key, "--label_key": d.label_key}, d.eval_dataset if eval else d.prompt_data
    )
    return raw


def critic_export_dir(cfg: PPOConfig) -> str | None:
    """--save_value_network: where the trained critic's HF folder goes, OpenRLHF's `<save_path>_critic`."""
    return f"{str(cfg.ckpt.save_path).rstrip('/')}_critic" if cfg.model.save_value_network else None


def load_prompts(cfg: PPOConfig, tokenizer, raw: datasets.Dataset) -> PromptDataset:
    """Rows of `load_prompt_rows` rendered and tokenized (prompts longer than --prompt_max_len dropped)."""
    d = cfg.data
    return PromptDataset(
        raw,
        tokenizer,
        input_key=d.input_key,
        label_key=d.label_key,
        apply_chat_template=d.apply_chat_template,
        input_template=d.input_template,
        max_prompt_len=d.prompt_limit(),
    )


def rollout_parts(cfg: PPOConfig, groups: Groups, tokenizer, agent_episodes=None) -> tuple[RolloutSource, Scorer]:
    """The run's rollout source and scorer, chosen once: the agent's episodes for both (`agent_episodes(cfg,
    tokenizer)`, built before Ray starts so that a broken agent file fails first), or single-turn generation scored
    by the reward source (--remote_rm_url) or else the reward model's ranks."""
    from openppo.ppo.collector import AgentEpisodes, SingleTurn, TextRewards

    single = SingleTurn(groups.engines, cfg)
    if agent_episodes is not None:
        agent = AgentEpisodes(single, agent_episodes)
        return agent, agent
    if groups.reward_source is not None:
        return single, TextRewards(groups.reward_source, tokenizer)
    assert groups.reward is not None, "validation requires a reward model or a reward source"
    groups.reward.pad_token_id = tokenizer.pad_token_id
    return single, groups.reward


def agent_episodes(cfg: PPOConfig, tokenizer):
    """`(generate, items, n) -> samples` running the `--agent_func_path` environment's episodes.

    Each model turn may use up to --generate_max_len new tokens; prompt, every turn and the environment's feedback
    together stay within the engines' context length (--max_len, default --prompt_max_len + --generate_max_len).
    """
    from openppo.agents import load_agent_env, run_agent_episodes

    env_cls = load_agent_env(cfg.rollout.agent_func_path)
    d = cfg.data

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
        )

    return rollout


def kv_cache_bytes(cfg: PPOConfig) -> int | None:
    """Each engine worker's KV cache in bytes: --vllm_kv_cache_bytes when given; on GPU otherwise None (vLLM sizes
    it from --vllm_gpu_memory_utilization); on CPU sized from the rollouts the run generates and capped by the RAM
    its other processes leave (`memory_plan.cpu_kv_cache_bytes`, logged in one line). Call before the model groups
    start loading, so that the free RAM it reads is not already taken by them."""
    import psutil

    from openppo.ppo.memory_plan import cpu_kv_cache_bytes, dtype_bytes, host_bytes_of_trainers, run_shapes

    v, r = cfg.vllm, cfg.rollout
    if v.vllm_kv_cache_bytes or torch.cuda.is_available():
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
        others=host_bytes_of_trainers(cfg, shapes),
        share=v.vllm_gpu_memory_utilization,
        engines=v.vllm_num_engines * tp,
    )
    logger.info(size.reason)
    return size.bytes


def cpu_threads_per_process(cfg: PPOConfig) -> int:
    """Threads for each worker and engine. Stages run one after another in a synchronous step, so only the ranks
    of one group compete for the cores at a time; with --async_train the engines generate while the actor trains,
    so they split the cores. On GPU machines the CPU threads matter little."""
    if "OMP_NUM_THREADS" in os.environ:
        return int(os.environ["OMP_NUM_THREADS"])
    if torch.cuda.is_available():
        return 4
    busy = actor_world_size(cfg) + (cfg.vllm.vllm_num_engines if cfg.rollout.async_train else 0)
    return max(1, (os.cpu_count() or 1) // busy)


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
        # CPU: resources are logical slots for placement, not cores; threads are budgeted per worker.
        kwargs["num_cpus"] = max(16, os.cpu_count() or 1)
    ray.init(**kwargs)


def build_groups(cfg: PPOConfig, plan: RunPlan, reward_source, kv_bytes: int | None) -> Groups:
    """Start every model group and the engines; `kv_bytes` is each engine worker's KV cache (`kv_cache_bytes`)."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from openppo.distributed.logs import actor_infos
    from openppo.distributed.placement import make_placement_group
    from openppo.distributed.worker_group import WorkerGroup
    from openppo.ppo.groups import ActorGroup, CriticGroup, ReferenceGroup, RewardGroup
    from openppo.ppo.workers import ActorWorker, CriticWorker, ReferenceWorker, RewardWorker
    from openppo.rollout import VLLMEngine
    from openppo.rollout.pool import EnginePool

    timeout = float(cfg.ds.dist_timeout)
    env = {"OMP_NUM_THREADS": str(cpu_threads_per_process(cfg))}
    gpu = 1.0 if torch.cuda.is_available() else 0.0
    shared = {}  # role -> (placement group, share of each bundle)
    for colocated in colocation_pools(cfg, set(plan.roles) | {"engines"}):
        pg = make_placement_group(
            colocated.bundles, cpus_per_bundle=1.0, gpus_per_bundle=gpu, timeout_s=timeout, name=f"{colocated.name}-pg"
        )
        shared.update({role: (pg, colocated.fraction) for role in colocated.members})
        logger.info("colocated (%s): %s", colocated.name, colocated.describe())

    def start(handle, worker, name):
        """The role's worker group, its `setup` started on every rank (its models load in parallel with the
        other groups' and the engines')."""
        role = plan.roles[name]
        pg, share = shared.get(name, (None, 1.0))
        workers = WorkerGroup(
            worker,
            role.ranks,
            placement_group=pg,
            num_cpus_per_worker=share,
            num_gpus_per_worker=gpu * share,
            env=env,
            name=name,
            timeout_s=timeout,
        )
        return handle(
            workers, replicas=role.replicas, balance=plan.balance, share=role.share_prompts
        ), workers.run_async(worker.setup, cfg, role)

    handles = {
        "actor": (ActorGroup, ActorWorker),
        "reference": (ReferenceGroup, ReferenceWorker),
        "critic": (CriticGroup, CriticWorker),
        "reward": (RewardGroup, RewardWorker),
    }
    started = {name: start(*handles[name], name) for name in plan.roles}
    groups = {name: group for name, (group, _) in started.items()}
    engine_cls = ray.remote(VLLMEngine)
    engines = []
    for i in range(cfg.vllm.vllm_num_engines):
        pg, share = shared.get("engines", (None, None))
        place = engine_placement(cfg, i, on_gpu=bool(gpu), hybrid_share=share)
        options: dict[str, Any] = {
            "runtime_env": {"env_vars": {**env, **dict(place.env)}},
            "num_cpus": place.num_cpus,
            "num_gpus": place.num_gpus,
        }
        if place.bundles is not None:  # hybrid engine: its workers on the devices of actor ranks i*tp .. i*tp+tp-1
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=place.bundles[0], placement_group_capture_child_tasks=True
            )
        engines.append(
            engine_cls.options(**options).remote(
                cfg.model.pretrain,
                dtype=plan.engine_dtype,
                seed=cfg.train.seed + i,
                max_model_len=cfg.data.total_len(),
                enforce_eager=cfg.vllm.enforce_eager or not torch.cuda.is_available(),
                enable_prefix_caching=cfg.vllm.enable_prefix_caching,
                gpu_memory_utilization=cfg.vllm.vllm_gpu_memory_utilization,
                kv_cache_bytes=kv_bytes,
                tensor_parallel_size=cfg.vllm.vllm_tensor_parallel_size,
                enable_sleep=cfg.vllm.vllm_enable_sleep,
                executor=place.executor,
                partial_rollout=cfg.rollout.partial_rollout,
            )
        )
    ray.get([e.ready.remote() for e in engines], timeout=timeout)
    pool = EnginePool(engines, actor_infos(engines, timeout), timeout_s=timeout, partial=cfg.rollout.partial_rollout)
    for i, info in enumerate(pool.infos):
        logger.info("vLLM engine %d: pid %s on %s (actor %s)", i, info["pid"], info["node_ip"], info["actor_id"])
    results = {name: group.workers.get(setups) for name, (group, setups) in started.items()}
    if "reward" in groups:
        groups["reward"].normalization = check_reward_normalization(cfg, results["reward"][0])
    backend = "nccl" if torch.cuda.is_available() and cfg.vllm.vllm_sync_backend == "nccl" else "gloo"
    actor = groups["actor"]
    transports = sync_plan(cfg, actor.worker_infos, pool.infos, backend, on_gpu=bool(gpu))
    actor.connect_engines(
        pool,
        transports,
        backend,
        cfg.vllm.vllm_tensor_parallel_size,
        bucket_bytes=cfg.vllm.vllm_sync_bucket_mb * 2**20,
        engine_dtype=plan.engine_dtype,
    )
    return Groups(
        actor=actor,
        engines=pool,
        critic=groups.get("critic"),
        reference=groups.get("reference"),
        reward=groups.get("reward"),
        reward_source=reward_source,
    )


def sync_plan(cfg: PPOConfig, rank_infos: list[dict], engine_infos: list[dict], backend: str, *, on_gpu: bool):
    """How each engine gets the weights (a `openppo.rollout.transport.SyncPlan`), logged in one line; a broadcast
    group that would hold two processes of one GPU is refused here, before the first sync."""
    from openppo.rollout.transport import (
        BROADCAST,
        OBJECT_STORE,
        Where,
        check_broadcast_group,
        choose_transports,
        describe,
    )

    ranks = [Where.of(info) for info in rank_infos]
    if cfg.resources.colocate_all_models:
        # worker w of engine i sits on actor rank i*tp + w's bundle (the engine actor itself may hold no GPU)
        tp = cfg.vllm.vllm_tensor_parallel_size
        workers = [[ranks[i * tp + w] for w in range(tp)] for i in range(len(engine_infos))]
    else:
        workers = [[Where.of(info)] for info in engine_infos]
    plan = choose_transports(
        ranks,
        workers,
        colocated=cfg.resources.colocate_all_models,
        on_gpu=on_gpu,
        remote=OBJECT_STORE if cfg.vllm.vllm_sync_with_ray else BROADCAST,
    )
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
    from openppo.distributed.logs import find_dead

    if groups is not None and len(groups.engines):
        dead = find_dead(groups.engines.engines, groups.engines.infos, "vLLM engine")
        if dead is not None:
            raise dead from error


def shutdown(groups: Groups | None) -> None:
    import ray

    if groups is not None:
        for g in groups.models():
            g.shutdown()
    if ray.is_initialized():
        ray.shutdown()
