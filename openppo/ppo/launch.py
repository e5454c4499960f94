"""Building a PPO run: data and reward source (validated before Ray starts), worker groups, engines."""

from __future__ import annotations

import logging
import os
from typing import Any

import torch

from openppo.datasets import PromptDataset, load_blended_dataset, require_columns
from openppo.ppo.config import PPOConfig
from openppo.ppo.trainer import Groups, needs_critic_group, needs_reference
from openppo.ppo.validate import actor_world_size

logger = logging.getLogger(__name__)


def load_prompts(cfg: PPOConfig, tokenizer) -> PromptDataset:
    d = cfg.data
    raw = load_blended_dataset(d.prompt_data, d.prompt_data_probs, flag="--prompt_data",
                               probs_flag="--prompt_data_probs", seed=cfg.train.seed, max_samples=d.max_samples)
    require_columns(raw, {"--input_key": d.input_key, "--label_key": d.label_key}, d.prompt_data)
    return PromptDataset(raw, tokenizer, input_key=d.input_key, label_key=d.label_key,
                         apply_chat_template=d.apply_chat_template, input_template=d.input_template,
                         max_prompt_len=d.prompt_max_len)


def num_training_steps(cfg: PPOConfig, num_prompts: int) -> int:
    """Optimizer steps of the actor over the whole run (the LR schedule's length)."""
    r, t = cfg.rollout, cfg.train
    rl_steps = (num_prompts // r.rollout_batch_size) * t.num_episodes
    if t.max_steps > 0:
        rl_steps = min(rl_steps, t.max_steps)
    per_step = r.rollout_batch_size * r.n_samples_per_prompt * t.max_epochs // t.train_batch_size
    return max(1, rl_steps * per_step)


def kv_cache_bytes(cfg: PPOConfig) -> int | None:
    """On CPU: the explicit flag, else the share of available RAM split over the engines."""
    v = cfg.vllm
    if torch.cuda.is_available():
        return v.vllm_kv_cache_bytes
    if v.vllm_kv_cache_bytes:
        return v.vllm_kv_cache_bytes
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return int(v.vllm_gpu_memory_utilization * available / v.vllm_num_engines)


def cpu_threads_per_process(cfg: PPOConfig) -> int:
    """Threads for each worker and engine. Stages run one after another in a synchronous step, so only the ranks
    of one group compete for the cores at a time; on GPU machines the CPU threads matter little."""
    if "OMP_NUM_THREADS" in os.environ:
        return int(os.environ["OMP_NUM_THREADS"])
    if torch.cuda.is_available():
        return 4
    return max(1, (os.cpu_count() or 1) // actor_world_size(cfg))


def start_ray() -> None:
    import ray

    if ray.is_initialized():
        return
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # address="local": always start our own cluster; never attach to another job's on this machine.
    kwargs: dict[str, Any] = {"address": "local", "include_dashboard": False, "log_to_driver": True,
                              "runtime_env": {"env_vars": {"TOKENIZERS_PARALLELISM": "false",
                                                           "RAY_AUTH_MODE": "disabled"}}}
    if not torch.cuda.is_available():
        # CPU: resources are logical slots for placement, not cores; threads are budgeted per worker.
        kwargs["num_cpus"] = max(16, os.cpu_count() or 1)
    ray.init(**kwargs)


def build_groups(cfg: PPOConfig, num_prompts: int, reward_source) -> Groups:
    import ray

    from openppo.distributed.worker_group import WorkerGroup
    from openppo.ppo.workers import CriticWorker, PolicyWorker, ReferenceWorker, RewardWorker
    from openppo.rollout import VLLMEngine

    res, timeout = cfg.resources, float(cfg.ds.dist_timeout)
    steps = num_training_steps(cfg, num_prompts)
    env = {"OMP_NUM_THREADS": str(cpu_threads_per_process(cfg))}
    gpu = 1.0 if torch.cuda.is_available() else 0.0

    def group(worker, nodes, per_node, name):
        return WorkerGroup(worker, nodes * per_node, num_cpus_per_worker=1, num_gpus_per_worker=gpu, env=env,
                           name=name, timeout_s=timeout)

    policy = group(PolicyWorker, res.actor_num_nodes, res.actor_num_gpus_per_node, "actor")
    pending = [(policy, policy.run_async("init_role", cfg, steps))]
    reference = critic = reward = None
    if needs_reference(cfg):
        reference = group(ReferenceWorker, res.ref_num_nodes, res.ref_num_gpus_per_node, "reference")
        pending.append((reference, reference.run_async("init_role", cfg)))
    if needs_critic_group(cfg):
        critic = group(CriticWorker, res.critic_num_nodes, res.critic_num_gpus_per_node, "critic")
        pending.append((critic, critic.run_async("init_role", cfg, steps)))
    normalization = None
    if reward_source is None:
        reward = group(RewardWorker, res.reward_num_nodes, res.reward_num_gpus_per_node, "reward")
        pending.append((reward, reward.run_async("init_role", cfg)))
    engine_cls = ray.remote(num_cpus=1, num_gpus=gpu * cfg.vllm.vllm_tensor_parallel_size)(VLLMEngine)
    engine_dtype = "float32" if cfg.ds.param_dtype == "fp32" else "bfloat16"
    engines = [engine_cls.options(runtime_env={"env_vars": env}).remote(
        cfg.model.pretrain, dtype=engine_dtype, seed=cfg.train.seed + i,
        max_model_len=cfg.data.prompt_max_len + cfg.data.generate_max_len, enforce_eager=cfg.vllm.enforce_eager or
        not torch.cuda.is_available(), enable_prefix_caching=cfg.vllm.enable_prefix_caching,
        gpu_memory_utilization=cfg.vllm.vllm_gpu_memory_utilization, kv_cache_bytes=kv_cache_bytes(cfg),
        tensor_parallel_size=cfg.vllm.vllm_tensor_parallel_size)
        for i in range(cfg.vllm.vllm_num_engines)]
    ray.get([e.ready.remote() for e in engines], timeout=timeout)
    results = {id(g): g.get(refs) for g, refs in pending}
    if reward is not None:
        normalization = results[id(reward)][0]
    backend = "nccl" if torch.cuda.is_available() and cfg.vllm.vllm_sync_backend == "nccl" else "gloo"
    policy.run("connect_engines", engines, backend, cfg.vllm.vllm_tensor_parallel_size, timeout)
    return Groups(policy=policy, engines=engines, critic=critic, reference=reference, reward=reward,
                  reward_source=reward_source, reward_normalization=normalization)


def shutdown(groups: Groups | None) -> None:
    import ray

    if groups is not None:
        for g in (groups.policy, groups.critic, groups.reference, groups.reward):
            if g is not None:
                g.shutdown()
    if ray.is_initialized():
        ray.shutdown()
