"""The single controller of RL training: one PPO step, top to bottom.

    generate (vLLM engines) -> score (reward source or reward model) -> old/ref log-probs, values (DeepSpeed
    groups) -> advantages (openppo.algorithms) -> critic and actor updates -> weight sync to the engines

The controller holds no model: it owns the prompt order, the KL controller and the metrics, and calls the worker
groups on shards of the batch (rank i gets the i-th contiguous shard; groups are whole, so shards stay aligned).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from openppo.algorithms import build_kl_controller, masked_mean, needs_critic
from openppo.ppo.config import PPOConfig
from openppo.ppo.experience import Sample, collate_samples, compute_advantages_for_batch
from openppo.utils.tracking import MetricsTracker

logger = logging.getLogger(__name__)


@dataclass
class Groups:
    """The worker groups and engines the controller drives (None where the run does not need one)."""

    policy: Any
    engines: list[Any]
    critic: Any = None
    reference: Any = None
    reward: Any = None
    reward_source: Any = None  # a RewardSource when scoring is not done by a reward model
    reward_normalization: tuple[float, float] | None = None


def _shards(data: dict[str, torch.Tensor], n: int) -> list[dict[str, torch.Tensor]]:
    size = next(iter(data.values())).size(0)
    assert size % n == 0, f"batch of {size} does not split over {n} ranks"
    step = size // n
    return [{k: v[i * step:(i + 1) * step] for k, v in data.items()} for i in range(n)]


class PPOTrainer:
    def __init__(self, cfg: PPOConfig, groups: Groups, tokenizer, prompts, tracker: MetricsTracker):
        self.cfg = cfg
        self.groups = groups
        self.tokenizer = tokenizer
        self.prompts = prompts  # PromptDataset: items with prompt, prompt_ids, label, index
        self.tracker = tracker
        self.kl_ctl = build_kl_controller(cfg.algo.init_kl_coef, cfg.algo.kl_target, cfg.algo.kl_horizon)
        self.global_step = 0
        self.engine_dtype = "float32" if cfg.ds.param_dtype == "fp32" else "bfloat16"

    # ------------------------------------------------------------------------------------------------ stages
    def generate(self, items: list[dict]) -> list[Sample]:
        """Prompts split evenly over the engines (one request per engine); n samples per prompt, in order."""
        import ray

        r, engines = self.cfg.rollout, self.groups.engines
        chunks = [items[i::len(engines)] for i in range(len(engines))]
        refs = [engine.generate.remote([it["prompt_ids"] for it in chunk], n=r.n_samples_per_prompt,
                                       max_new_tokens=self.cfg.data.generate_max_len, temperature=r.temperature,
                                       top_p=r.top_p)
                for engine, chunk in zip(engines, chunks) if chunk]
        outputs = ray.get(refs, timeout=self.cfg.ds.dist_timeout)
        by_index = {}
        for chunk, out in zip([c for c in chunks if c], outputs):
            for item, completions in zip(chunk, out):
                by_index[item["index"]] = (item, completions)
        samples = []
        for item in items:  # back to prompt order: groups of n consecutive samples
            item, completions = by_index[item["index"]]
            for c in completions:
                samples.append(Sample(prompt_ids=list(item["prompt_ids"]), response_ids=c["token_ids"],
                                      rollout_log_probs=c["logprobs"], finish_reason=c["finish_reason"],
                                      group=item["index"], label=item["label"], prompt_text=item["prompt"],
                                      policy_version=self.global_step))
        return samples

    def score(self, samples: list[Sample], batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict]:
        """Raw rewards [B] from the reward source (on text) or the reward model (on tokens)."""
        if self.groups.reward_source is not None:
            responses = self.tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
            prompts = [s.prompt_text for s in samples]
            result = self.groups.reward_source.score([p + r for p, r in zip(prompts, responses)], prompts,
                                                     [s.label for s in samples])
            extra = {f"reward/{k}": sum(v) / len(v) for k, v in result.extra_logs.items() if v}
            return torch.tensor(result.rewards, dtype=torch.float32), extra
        data = {k: batch[k] for k in ("sequences", "attention_mask")}
        scores = self.groups.reward.run_sharded("scores", _shards(data, self.groups.reward.num_workers))
        return torch.cat(scores), {}

    def forward(self, group, method: str, data: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat(group.run_sharded(method, _shards(data, group.num_workers)))

    # ------------------------------------------------------------------------------------------------ one step
    def step(self, items: list[dict]) -> dict[str, float]:
        cfg, g = self.cfg, self.groups
        timing: dict[str, float] = {}

        def timed(name, fn, *args):
            start = time.perf_counter()
            out = fn(*args)
            timing[f"timing/{name}"] = time.perf_counter() - start
            return out

        samples = timed("generate", self.generate, items)
        batch = collate_samples(samples, self.tokenizer.pad_token_id)
        scores, reward_logs = timed("reward", self.score, samples, batch)
        model_in = {k: batch[k] for k in ("sequences", "attention_mask")}
        old_log_probs = timed("old_logprob", self.forward, g.policy, "log_probs", model_in)
        ref_log_probs = timed("ref_logprob", self.forward, g.reference, "log_probs", model_in) \
            if g.reference is not None else None
        values = timed("values", self.forward, g.critic, "values", model_in) if g.critic is not None else None
        start = time.perf_counter()
        adv = compute_advantages_for_batch(batch, scores, algo=cfg.algo, n_samples_per_prompt=cfg.rollout.
                                           n_samples_per_prompt, generate_max_len=cfg.data.generate_max_len,
                                           kl_coef=self.kl_ctl.value, log_probs=old_log_probs,
                                           ref_log_probs=ref_log_probs, values=values,
                                           reward_mean_std=g.reward_normalization)
        timing["timing/advantages"] = time.perf_counter() - start
        mask = batch["action_mask"]
        train_data = {"sequences": batch["sequences"], "attention_mask": batch["attention_mask"],
                      "action_mask": mask, "old_log_probs": old_log_probs, "advantages": adv["advantages"],
                      "rollout_log_probs": batch["rollout_log_probs"]}
        if ref_log_probs is not None and cfg.algo.use_kl_loss:
            train_data["ref_log_probs"] = ref_log_probs
        self.global_step += 1
        metrics: dict[str, float] = {}
        if g.critic is not None:
            critic_data = {**{k: train_data[k] for k in ("sequences", "attention_mask", "action_mask")},
                           "old_values": values, "returns": adv["returns"]}
            metrics.update(timed("critic_train", lambda: g.critic.run_sharded(
                "train", _shards(critic_data, g.critic.num_workers), global_step=self.global_step)[0]))
        if self.global_step > cfg.train.freezing_actor_steps:
            metrics.update(timed("actor_train", lambda: g.policy.run_sharded(
                "train", _shards(train_data, g.policy.num_workers), kl_coef=self.kl_ctl.value,
                global_step=self.global_step)[0]))
            sync = timed("weight_sync", lambda: g.policy.run(
                "sync_weights", g.engines, cfg.vllm.vllm_sync_bucket_mb * 2**20, self.engine_dtype,
                float(cfg.ds.dist_timeout))[0])
            metrics["perf/weight_sync_mb"] = sync["num_bytes"] / 2**20
        kl = masked_mean(adv["kl"], mask).item()
        self.kl_ctl.update(kl, len(samples))
        response_len = batch["response_length"].float()
        metrics.update({
            "rollout/reward": scores.mean().item(), "reward": scores.mean().item(), "kl": kl,
            "rollout/kl_coef": self.kl_ctl.value, "response_length": response_len.mean().item(),
            "rollout/truncated_ratio": batch["truncated"].float().mean().item(),
            "rollout/logprob_diff": masked_mean((batch["rollout_log_probs"] - old_log_probs).abs(), mask).item(),
            "rollout/advantage_abs": masked_mean(adv["advantages"].abs(), mask).item(),
            "policy_loss": metrics.get("loss/policy", float("nan")),
            "value_loss": metrics.get("loss/value", float("nan")),
            "clip_ratio": metrics.get("policy/clip_ratio", float("nan")),
            "entropy": metrics.get("policy/entropy", float("nan")),
            **reward_logs, **timing})
        return metrics

    # ------------------------------------------------------------------------------------------------ loop
    def fit(self) -> list[dict[str, float]]:
        cfg = self.cfg
        history = []
        order_gen = torch.Generator().manual_seed(cfg.train.seed)
        steps_per_episode = len(self.prompts) // cfg.rollout.rollout_batch_size
        total = steps_per_episode * cfg.train.num_episodes
        if cfg.train.max_steps > 0:
            total = min(total, cfg.train.max_steps)
        for episode in range(cfg.train.num_episodes):
            order = torch.randperm(len(self.prompts), generator=order_gen).tolist()
            for i in range(steps_per_episode):
                if self.global_step >= total:
                    return history
                ids = order[i * cfg.rollout.rollout_batch_size:(i + 1) * cfg.rollout.rollout_batch_size]
                metrics = self.step([self.prompts[j] for j in ids])
                metrics["train/episode"] = episode
                history.append(metrics)
                self.tracker.log(self.global_step, metrics, echo=self.global_step % cfg.logging.logging_steps == 0)
        return history


def needs_reference(cfg: PPOConfig) -> bool:
    return cfg.algo.init_kl_coef > 0


def needs_critic_group(cfg: PPOConfig) -> bool:
    return needs_critic(cfg.algo.advantage_estimator)
