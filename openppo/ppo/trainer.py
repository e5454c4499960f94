"""The single controller of RL training: one PPO step, top to bottom (`PPOTrainer.step`).

    generate -> score -> old / ref / value forwards -> advantages -> critic and actor updates -> weight sync

Where each call goes (driver: this process; ranks and engines: Ray actors):

    step -+ Collector.collect (ppo/collector.py: prompt order, dynamic filtering; --async_train: a thread ahead)
          |    +-> SingleTurn.generate (prompts round-robin over the engines) --> VLLMEngine.generate --> vLLM
          |        (AgentEpisodes.generate: the --agent_func_path episodes, each turn a SingleTurn.generate)
          |    +-> TextRewards.score --> reward function / HTTP server (--remote_rm_url)
          |        or RewardGroup.score --> RewardWorker.scores (the reward model's ranks)
          + ActorGroup.log_probs / ReferenceGroup.log_probs / CriticGroup.values     (ppo/groups.py: deal rows)
          |    +-> ActorWorker.log_probs ... (ppo/workers.py, one per rank) --> DeepSpeed engine --> Actor.forward
          + compute_advantages_for_batch (ppo/experience.py --> algorithms/: pure tensor math)
          + CriticGroup.train / ActorGroup.train
          |    +-> CriticWorker.train / ActorWorker.train --> fit_experience (ppo/fit.py) --> engine.backward, step
          + ActorGroup.sync_weights --> ActorWorker.sync_weights --> TrainerTransfer.send_weights --> vLLM's workers
               (vLLM's weight-transfer calls, openppo's backend; one bucket at a time: broadcast, shared memory /
               CUDA IPC, or Ray's object store)

The controller holds no model: it owns the step count, the KL controller, checkpoints of its own state and the
metrics. Memory swapping for colocated runs (engines asleep while the trainer works, trainer states offloaded
while the engines generate) is in `MemorySwap`.
"""

from __future__ import annotations

import json
import logging
import math
import time
from contextlib import AbstractContextManager
from pathlib import Path

import torch
from tqdm import tqdm

from openppo.algorithms import build_kl_controller, engine_gap, masked_mean, sequence_kl
from openppo.errors import UserError
from openppo.ppo import rollout_archive
from openppo.ppo.collector import (
    Collector,
    PromptStream,
    Rollout,
    RolloutProducer,
    RolloutSource,
    Scorer,
    staleness,
)
from openppo.ppo.colocation import MemorySwap
from openppo.ppo.config import PPOConfig
from openppo.ppo.experience import collate_samples, compute_advantages_for_batch, training_rows
from openppo.ppo.groups import Groups, TrainedGroup
from openppo.ppo.plan import RunPlan
from openppo.ppo.reporting import RunHistory, idle_seconds, step_throughput, timed
from openppo.ppo.teachers import distill_step, parse_teachers, rows_for_ranks, teacher_rows
from openppo.rollout.pool import Sample
from openppo.strategy import checkpoint as ckpt
from openppo.utils.hardware import rss_gib
from openppo.utils.images import BATCH_KEY as IMAGES
from openppo.utils.profiling import StepProfiler, parse_profile_steps
from openppo.utils.tracking import MetricsTracker, set_aside_rows_after

logger = logging.getLogger(__name__)
# the progress bar's figures (the log lines and the sinks carry every metric)
_PROGRESS_KEYS = ("train/reward", "train/kl", "train/policy_loss", "train/response_length", "rollout/logprob_diff")


class PPOTrainer:
    def __init__(
        self,
        cfg: PPOConfig,
        plan: RunPlan,
        groups: Groups,
        tokenizer,
        prompts,
        tracker: MetricsTracker,
        source: RolloutSource,
        scorer: Scorer,
        eval_prompts=None,
        teacher_routes: list[int] | None = None,
    ):
        self.cfg, self.plan = cfg, plan
        # --teacher_pretrain: the teachers' names (metrics) and each dataset row's teacher (`teachers.route`)
        self.teacher_names = [t.name for t in parse_teachers(cfg.model.teacher_pretrain)]
        self.teacher_routes = teacher_routes
        self.groups = groups
        # an agent episode's segments make the row count vary: it is padded to a multiple of every group's
        # data-parallel ranks, which take equal shares (`training_rows`)
        self._row_multiple = math.lcm(*(r.ranks // (r.ring * r.tensor_parallel) for r in plan.roles.values()))
        self.tokenizer = tokenizer
        self.eval_prompts = eval_prompts
        self.tracker = tracker
        self.kl_ctl = build_kl_controller(cfg.algo.init_kl_coef, cfg.algo.kl_target, cfg.algo.kl_horizon)
        self.stream = PromptStream(
            len(prompts),
            rollout_batch_size=cfg.rollout.rollout_batch_size,
            num_episodes=cfg.train.num_episodes,
            seed=cfg.train.seed,
        )
        # prompts (PromptDataset items: prompt, prompt_ids, label, index, datasource) -> scored rollout batches
        self.collector = Collector(cfg, prompts, source, scorer, self.stream, lambda: self.policy_version)
        self._collect = self.collector.collect  # (`fit` puts --rollout_dump_dir / --rollout_replay_dir around it)
        self.total_steps = plan.rl_steps
        self.global_step = 0
        self.policy_version = 0  # weight syncs done: the version the engines generate with
        self._syncs_checked = 0  # syncs --vllm_sync_check checked
        self.ckpt_dir = Path(cfg.ckpt.checkpoint_dir())
        self._timing: dict[str, float] = {}  # this step's timing/* (the batch's own come with it)
        self._data_position = self.stream.state_dict()  # the prompt position of the last trained batch
        self._producer: RolloutProducer | None = None
        self._profiler: StepProfiler | None = None  # the driver's trace while a --profile_steps step runs
        if not plan.old_logprob_pass:
            logger.info(
                "one on-policy optimizer step per batch and no reference model: the update's own "
                "log-probs are the old log-probs (no separate old-log-prob pass)"
            )
        self.swap = MemorySwap(cfg, groups, self.timer)
        groups.engines.on_replace = self._engines_replaced
        Path(cfg.ckpt.save_path).mkdir(parents=True, exist_ok=True)
        self._rollout_log = open(Path(cfg.ckpt.save_path) / "rollouts.jsonl", "a", buffering=1)

    def timer(self, stage: str) -> AbstractContextManager:
        """`with self.timer("stage"):` adds the block's wall time to this step's `timing/<stage>`."""
        return timed(self._timing, stage)

    # ------------------------------------------------------------------------------------------------ rollout
    def _rollout_ahead(self) -> Rollout | None:
        """--async_train: the oldest of the batches generated ahead (None when the prompts ran out)."""
        rollout, waited = self._producer.get()
        if rollout is not None:
            rollout.timing["timing/wait_rollout"] = waited
        return rollout

    def _log_rollout(self, rollout: Rollout) -> None:
        """rollouts.jsonl: per step the prompts trained on, all prompts drawn (dynamic filtering draws more) and one
        decoded example."""
        samples, scores = rollout.samples, rollout.scores
        first = samples[0]
        example = {
            "prompt": first.prompt_text,
            "response": self.tokenizer.decode(first.response_ids, skip_special_tokens=True),
            "reward": float(scores[0]),
        }
        groups = list(dict.fromkeys(s.group for s in samples))
        self._rollout_log.write(
            json.dumps({"step": self.global_step, "prompts": groups, "taken": rollout.taken, "example": example}) + "\n"
        )

    # ------------------------------------------------------------------------------------------------ one step
    def _synced(self) -> None:
        """After each weight sync: the engines generate with the next policy version (checked with
        --vllm_sync_check after the first sync, and with --vllm_sync_delta also after the first delta sync)."""
        self.policy_version += 1
        if self.cfg.vllm.vllm_sync_check and self._syncs_checked < 1 + self.cfg.vllm.vllm_sync_delta:
            self._check_engine_weights()

    def _check_engine_weights(self) -> None:
        """--vllm_sync_check: the engines compute with the trainer's weights, tensor by tensor (the first sync after
        an update is the one where a dropped name or an unmerged LoRA shows; before it, both sides hold the
        checkpoint)."""
        checks = self.groups.actor.check_engine_weights(self.groups.engines)
        bad = [f"engine {i}: {summary}" for i, (ok, summary) in enumerate(checks) if not ok]
        if bad:
            raise RuntimeError(
                "--vllm_sync_check: after the weight sync the engines compute with other weights than "
                "the trainer's, so rollouts would not come from the trained policy: " + "; ".join(bad)
            )
        logger.info("--vllm_sync_check: %d engine(s) compute with the trainer's weights: %s", len(checks), checks[0][1])
        self._syncs_checked += 1

    def step(self) -> dict[str, float] | None:
        """One RL step on the next rollout batch; None when the prompts ran out before the batch was full."""
        g = self.groups
        start = time.perf_counter()
        # generate + score: n responses per prompt from the engines, rewards from the reward source or model
        # (--async_train: generated ahead by older weights while the last step trained)
        rollout = self._collect() if self._producer is None else self._rollout_ahead()
        if rollout is None:
            return None
        with g.actor.lock:  # the step's actor calls, up to its weight sync (`ActorGroup.lock`)
            return self._train_on(rollout, start)

    def _train_on(self, rollout: Rollout, start: float) -> dict[str, float]:
        """The step after its rollout batch: forwards, advantages, updates, weight sync, metrics."""
        cfg, g = self.cfg, self.groups
        self._timing = dict(rollout.timing)
        self._data_position = rollout.stream_state
        self.swap.to_trainer()
        # an agent episode's segments are rows of their own, sharing its advantage (`training_rows`)
        rows, episode = training_rows(rollout.samples, self._row_multiple)
        segmented = any(s.segments for s in rollout.samples)
        batch = collate_samples(rows, self.tokenizer.pad_token_id)
        # the trained tokens that the weights about to be trained sampled (all of them, unless --async_train)
        batch["fresh"] = batch["action_mask"].bool() & (batch["versions"] == self.policy_version)
        # (with image prompts, the rows' images too: every model that scores the rows needs their pixels)
        model_in = {k: batch[k] for k in ("sequences", "attention_mask", "action_mask", IMAGES) if k in batch}

        # forwards: pi_old for the PPO ratio (none when the update is a single on-policy step), with --top_k/--top_p
        # also under the engines' truncation (the distribution their log-probs are of); pi_ref for the KL; V for GAE
        old = old_sampling = None
        if self.plan.old_logprob_pass:
            with self.timer("old_logprob"):
                if cfg.rollout.sampling.active:
                    old, old_sampling = g.actor.log_probs_and_sampling(model_in)
                else:
                    old = old_sampling = g.actor.log_probs(model_in)
        ref = values = None
        if g.reference is not None:
            with self.timer("ref_logprob"):
                ref = g.reference.log_probs(model_in)
        if g.critic is not None:
            with self.timer("values"):
                values = g.critic.values(model_in)
        teacher_lp = None
        if g.teachers:
            with self.timer("teacher_logprob"):
                teacher_lp, teacher_of = self._teacher_log_probs(rows, model_in)

        # advantages: rewards (KL-penalised where the KL is not a loss term) -> per-token advantages and returns
        with self.timer("advantages"):
            adv = compute_advantages_for_batch(
                batch,
                rollout.scores,
                algo=cfg.algo,
                n_samples_per_prompt=cfg.rollout.n_samples_per_prompt,
                generate_max_len=cfg.data.generate_max_len,
                kl_coef=self.kl_ctl.value,
                log_probs=old,
                ref_log_probs=ref,
                values=values,
                reward_mean_std=g.reward.normalization if g.reward else None,
                episode=episode if segmented else None,
            )
            distilled = {}
            if teacher_lp is not None:
                # on-policy distillation: log pi_T - log pi_S per sampled token (pi_S the trainer's pi_old), plus
                # --distill_task_coef x the task advantage just computed
                student = old if old is not None else batch["rollout_log_probs"]
                adv["advantages"], distilled = distill_step(
                    teacher_lp,
                    student,
                    batch["action_mask"],
                    adv["advantages"],
                    cfg.algo.distill_task_coef,
                    teacher_of,
                    self.teacher_names,
                )
        self.global_step += 1
        self._log_rollout(rollout)

        # update: the critic first (it needs the old values, not the new policy), then the actor
        # versions behind the weights being trained
        metrics = staleness(rollout.samples, self.policy_version, cfg.rollout.partial_rollout or segmented)
        metrics.update(distilled)
        if g.critic is not None:
            critic_data = {**model_in, "old_values": values, "returns": adv["returns"]}
            with self.timer("critic_train"):
                metrics.update(g.critic.train(critic_data, self.global_step))
        if self.global_step > cfg.train.freezing_actor_steps:
            train_data = {**model_in, "advantages": adv["advantages"], "rollout_log_probs": batch["rollout_log_probs"]}
            optional = {
                "old_log_probs": old,
                "old_sampling_log_probs": None if old_sampling is old else old_sampling,
                "ref_log_probs": ref if cfg.algo.use_kl_loss else None,
            }
            train_data.update({k: v for k, v in optional.items() if v is not None})
            with self.timer("actor_train"):
                metrics.update(g.actor.train(train_data, self.kl_ctl.value, self.global_step))
            # sync: the engines generate the next batch with the weights just trained
            self.swap.engine_weights()
            with self.timer("weight_sync"):
                stats = g.sync_engines(version=self.policy_version + 1)
            metrics["perf/weight_sync_mb"] = stats["num_bytes"] / 2**20
            metrics["perf/weight_sync_buckets"] = stats["num_buckets"]
            if "full_bytes" in stats:  # --vllm_sync_delta
                metrics["perf/weight_sync_changed"] = stats["changed"]
            self._synced()
        else:
            self.swap.engine_weights()
        self.swap.to_engines()
        return self._step_metrics(rollout, batch, adv, old_sampling, metrics, start)

    def _teacher_log_probs(
        self, rows: list[Sample], model_in: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Each teacher's log-probs of its rows' sampled tokens [B, T-1] (every teacher forwards only the rows routed
        to it), and the rows of each teacher."""
        groups = torch.tensor([s.group for s in rows], dtype=torch.long)
        rows = teacher_rows(groups, self.teacher_routes, len(self.groups.teachers))
        out = torch.zeros(model_in["action_mask"].shape, dtype=torch.float32)
        for teacher, r in zip(self.groups.teachers, rows):
            if len(r) == len(groups):
                out = teacher.log_probs(model_in)
            elif len(r):
                padded = rows_for_ranks(r, teacher.num_workers // teacher.replicas)
                out[r] = teacher.log_probs({k: v[padded] for k, v in model_in.items()})[: len(r)]
        return out, rows

    def _step_metrics(
        self,
        rollout: Rollout,
        batch: dict[str, torch.Tensor],
        adv: dict[str, torch.Tensor],
        old_sampling: torch.Tensor | None,
        metrics: dict[str, float],
        start: float,
    ) -> dict[str, float]:
        """The step's rollout, KL, timing and throughput metrics around the updates' own; moves the KL controller."""
        cfg, mask, scores = self.cfg, batch["action_mask"], rollout.scores
        kl = masked_mean(adv["kl"], mask).item()
        # The adaptive controller's target is in nats per response (Ziegler et al.), not per token.
        kl_response = sequence_kl(adv["kl"], mask).mean().item()
        self.kl_ctl.update(kl_response, len(rollout.samples))
        metrics.update(
            {
                "train/reward": scores.mean().item(),
                "train/kl": kl,
                "train/kl_per_response": kl_response,
                "train/kl_coef": self.kl_ctl.value,
                "train/response_length": batch["response_length"].float().mean().item(),
                "rollout/truncated_ratio": batch["truncated"].float().mean().item(),
                "train/advantage_abs": masked_mean(adv["advantages"].abs(), mask).item(),
                "train/episode": (rollout.stream_state["cursor"] - 1) // self.stream.per_episode,
                **rollout.logs,
            }
        )
        if old_sampling is not None:
            gap = engine_gap(batch["rollout_log_probs"], old_sampling, mask)
            metrics.update({f"rollout/{k}": float(v) for k, v in gap.items()})
            fresh = batch["fresh"]
            if fresh.any() and not torch.equal(fresh, mask.bool()):
                # some tokens come from older weights (--async_train): on the rest, the engine must equal the trainer
                gap = engine_gap(batch["rollout_log_probs"], old_sampling, fresh)
                metrics["rollout/logprob_diff_fresh"] = float(gap["logprob_diff"])
                metrics["rollout/logprob_diff_fresh_max"] = float(gap["logprob_diff_max"])
        timing = {**self._timing, "timing/step": time.perf_counter() - start}
        timing["timing/idle"] = idle_seconds(timing, timing["timing/step"])
        trained = int(batch["attention_mask"].sum()) * cfg.train.max_epochs
        metrics.update(timing)
        metrics.update(
            step_throughput(
                generated_tokens=int(batch["response_length"].sum()),
                trained_tokens=trained,
                samples=len(rollout.samples),
                timing=timing,
            )
        )
        metrics["perf/driver_rss_gib"] = rss_gib()
        metrics["rollout/engine_restarts"] = self.groups.engines.restarts
        return metrics

    def _profile(self, action: str) -> None:
        """--profile_steps: start, or stop and write, a torch profiler trace on the driver and every model rank."""
        if action == "start":
            self._profiler = StepProfiler()
            self._profiler.start()
            for g in self.groups.models():
                g.start_profile()
            return
        out = Path(self.cfg.ckpt.save_path) / "profile" / f"step{self.global_step}"
        self._profiler.stop(out / "driver.json")
        for g in self.groups.models():
            g.stop_profile(str(out))
        logger.info("profile of step %d: Chrome traces in %s", self.global_step, out)

    def _engines_replaced(self) -> None:
        """`EnginePool.on_replace`: dead engines were replaced while generating (on the rollout thread with
        --async_train): once the actor is between steps, bring every engine to its weights as the current version
        (unless a step's sync got there first). The swap makes room as a step's sync does."""
        g = self.groups
        if g.actor is None:  # --eval_only of --pretrain: a new engine loads it, as the others did
            g.engines.stale.clear()
            return
        with g.actor.lock:
            if not g.engines.stale:
                return
            self.swap.to_trainer()
            self.swap.engine_weights()
            began = time.perf_counter()
            g.sync_engines(version=self.policy_version)
            self.swap.to_engines()
            logger.info(
                "vLLM engines re-synced to weight version %d in %.1f s after a restart",
                self.policy_version,
                time.perf_counter() - began,
            )

    # ------------------------------------------------------------------------------------------------ eval
    def evaluate(self) -> dict[str, float]:
        """pass@1 / pass@k on the whole eval set with the current weights (engines must be awake)."""
        d = self.cfg.data
        timing: dict[str, float] = {}
        with timed(timing, "eval"):
            metrics = self.collector.evaluate(
                list(self.eval_prompts),
                d.eval_n_samples_per_prompt,
                d.eval_temperature,
                top_p=d.eval_top_p,
                max_new_tokens=d.eval_max_new_tokens,
                batch_size=d.eval_batch_size,
            )
        return {**metrics, **timing}

    def _keep_best(self, evaluation: dict[str, float]) -> None:
        """--best_metric_key: export the actor when this eval beats every earlier one (OpenRLHF keeps the best
        step as a checkpoint; here it is the HF folder users deploy, <ckpt_path>/best, and best.json)."""
        key = self.cfg.logging.best_metric_key
        if key is None or key == "none":
            return
        key = key or "eval/pass@1"
        if key not in evaluation:
            logger.warning("--best_metric_key %s: not an eval metric (these are: %s)", key, ", ".join(evaluation))
            return
        best = self.ckpt_dir / "best"
        record = json.loads((best / "best.json").read_text()) if (best / "best.json").is_file() else None
        if record is not None and record["metric"] == key and evaluation[key] <= record["value"]:
            return
        with self.groups.actor.lock:
            self.groups.actor.save_hf(str(best), self.cfg.model.pretrain)
        ckpt.write_json_atomic(best / "best.json", {"metric": key, "value": evaluation[key], "step": self.global_step})
        logger.info(
            "best %s so far (%.4g) at step %d: the actor is in %s", key, evaluation[key], self.global_step, best
        )

    def _eval_due(self, episode_end: bool) -> bool:
        every = self.cfg.logging.eval_steps
        if self.eval_prompts is None:
            return False
        return self.global_step % every == 0 if every > 0 else (every == -1 and episode_end)

    # ------------------------------------------------------------------------------------------------ checkpoints
    def _ckpt_parts(self) -> dict[str, TrainedGroup]:
        """The trained models of a checkpoint, by the subfolder of --ckpt_path each one saves into."""
        return {
            name: group
            for name, group in (("actor", self.groups.actor), ("critic", self.groups.critic))
            if group is not None
        }

    def save_checkpoint(self) -> None:
        """Every trained model saves its part of this step, then the controller commits the step (see
        `openppo.strategy.checkpoint`): a crash before the commit leaves the previous step the one to resume."""
        with self.groups.actor.lock:  # no engine re-sync in between (`ActorGroup.lock`)
            self._save_checkpoint()

    def _save_checkpoint(self) -> None:
        c = self.cfg.ckpt
        if c.save_hf_ckpt:
            hf_dir = ckpt.hf_export_dir(self.ckpt_dir, self.global_step)
            self.groups.actor.save_hf(str(hf_dir), self.cfg.model.pretrain)
            removed = ckpt.rotate_hf(self.ckpt_dir, c.max_ckpt_num)
            logger.info(
                "HF model of step %d saved to %s%s",
                self.global_step,
                hf_dir,
                f"; removed {', '.join(removed)}" if removed else "",
            )
        if c.disable_ds_ckpt:
            return
        state = {
            "global_step": self.global_step,
            "prompt_stream": self._data_position,
            "kl_controller": self.kl_ctl.state_dict(),
            "trainer": "ppo",
        }
        start = time.perf_counter()
        parts = self._ckpt_parts()
        ckpt.begin_save(self.ckpt_dir, self.global_step, list(parts))
        for name, group in parts.items():
            group.save_checkpoint(str(self.ckpt_dir / name), self.global_step, state)
        ckpt.commit(self.ckpt_dir, self.global_step, list(parts), state)
        removed = ckpt.rotate(self.ckpt_dir, c.resumable_keep(), self.global_step, list(parts), ckpt.max_bytes(c))
        logger.info(
            "checkpoint of step %d saved to %s in %.1f s%s",
            self.global_step,
            self.ckpt_dir,
            time.perf_counter() - start,
            f"; removed {', '.join(removed)}" if removed else "",
        )

    def resume(self) -> bool:
        """Restore actor, critic and controller state from the newest committed step and re-sync the engines."""
        commit = ckpt.resolve(self.ckpt_dir)
        if commit is None:
            logger.info("no checkpoint in %s yet: starting at step 0", self.ckpt_dir)
            for log in ("metrics.jsonl", "rollouts.jsonl"):  # rows of an attempt that died before its first commit
                set_aside_rows_after(Path(self.cfg.ckpt.save_path) / log, 0)
            return False
        parts = self._ckpt_parts()
        missing = [name for name in parts if name not in commit.parts]
        if missing:
            raise UserError(
                f"--load_checkpoint: the checkpoint of step {commit.step} in {self.ckpt_dir} has no "
                f"{' or '.join(missing)} (it was saved by a run without one); resume with the same "
                f"models, or delete {self.ckpt_dir} to start fresh"
            )
        for name, group in parts.items():
            group.load_checkpoint(str(self.ckpt_dir / name), commit.step)
        state = commit.state
        self.global_step = int(state["global_step"])
        self.stream.load_state_dict(state["prompt_stream"])
        self._data_position = self.stream.state_dict()
        self.kl_ctl.load_state_dict(state["kl_controller"])
        for log in ("metrics.jsonl", "rollouts.jsonl"):
            set_aside_rows_after(Path(self.cfg.ckpt.save_path) / log, self.global_step)
        self.policy_version = self.global_step - 1  # the engines get the checkpoint's weights as its version
        self.groups.sync_engines(version=self.global_step)
        self._synced()
        logger.info(
            "resumed from %s at step %d (prompt %d of %d); engines re-synced",
            self.ckpt_dir,
            self.global_step,
            self.stream.cursor,
            self.stream.total,
        )
        return True

    # ------------------------------------------------------------------------------------------------ loop
    def _episode(self) -> int:
        """The episode of the prompts trained so far (the stream itself runs ahead with --async_train)."""
        return self._data_position["cursor"] // self.stream.per_episode

    def fit(self, restarted: bool = False) -> RunHistory:
        """Train to the last step. `restarted`: this run's groups died and were started again in the same job
        (--max_rank_restarts): go on from the last committed checkpoint, as --load_checkpoint does."""
        cfg = self.cfg
        if cfg.ckpt.load_checkpoint or restarted:
            self.resume()
        self.swap.start()
        if cfg.data.eval_only:  # (validation: there is an eval set) the model as it starts, then nothing else
            self.tracker.log(self.global_step, self.evaluate(), echo=True)
            self.collector.source.close()
            self._rollout_log.close()
            return RunHistory()
        if cfg.data.eval_at_start and self.global_step == 0 and self.eval_prompts is not None:
            # the model the run starts from, before the first rollout is asked for (no producer yet)
            self.tracker.log(0, self.evaluate(), echo=True)
        t = cfg.train
        self._collect = self.collector.collect
        if t.rollout_replay_dir:
            self._collect = rollout_archive.replaying(t.rollout_replay_dir, self.global_step + 1)
        elif t.rollout_dump_dir:
            self._collect = rollout_archive.dumping(self.collector.collect, t.rollout_dump_dir, self.global_step + 1)
        if cfg.rollout.async_train:
            self._producer = RolloutProducer(
                self._collect,
                ahead=cfg.rollout.async_queue_size,
                limit=self.total_steps - self.global_step,
                timeout_s=float(cfg.ds.dist_timeout),
            )
            self._producer.start()
        try:
            return self._loop()
        finally:
            if self._producer is not None:
                self._producer.stop()
            self.collector.source.close()
            self._rollout_log.close()

    def _loop(self) -> RunHistory:
        cfg = self.cfg
        history = RunHistory()
        saved_step = None
        progress = tqdm(total=self.total_steps, initial=self.global_step, desc="RL steps", dynamic_ncols=True)
        traced_steps = set(parse_profile_steps(cfg.logging.profile_steps))
        while self.global_step < self.total_steps:
            episode = self._episode()
            traced = self.global_step + 1 in traced_steps
            if traced:
                with self.groups.actor.lock:
                    self._profile("start")
            metrics = self.step()
            if traced:
                with self.groups.actor.lock:
                    self._profile("stop")
            if metrics is None:
                logger.info(
                    "every prompt of the %d episode(s) was drawn by step %d (dynamic filtering draws more "
                    "than one batch of prompts per step); stopping",
                    self.stream.num_episodes,
                    self.global_step,
                )
                break
            if self._producer is not None:
                self._producer.step_done()
            history.add(metrics)
            progress.update(1)
            progress.set_postfix({k.split("/")[-1]: f"{metrics[k]:.3g}" for k in _PROGRESS_KEYS if k in metrics})
            # (with dynamic filtering an episode of prompts takes fewer steps than steps_per_episode)
            episode_end = self._episode() != episode or self.global_step == self.total_steps
            if self._eval_due(episode_end):
                evaluation = self.evaluate()
                metrics.update(evaluation)
                self._keep_best(evaluation)
            self.tracker.log(self.global_step, metrics, echo=self.global_step % cfg.logging.logging_steps == 0)
            if cfg.ckpt.save_steps > 0 and self.global_step % cfg.ckpt.save_steps == 0:
                self.save_checkpoint()
                saved_step = self.global_step
        if (cfg.ckpt.save_steps > 0 or cfg.ckpt.load_checkpoint) and saved_step != self.global_step and history:
            self.save_checkpoint()
        progress.close()
        return history
