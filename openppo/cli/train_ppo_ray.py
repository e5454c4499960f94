"""RL training (PPO, GRPO, Dr.GRPO, REINFORCE++, RLOO, GSPO) on Ray + DeepSpeed + vLLM:
`python -m openppo.cli.train_ppo_ray ...` or `ray job submit -- python -m openppo.cli.train_ppo_ray ...`."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from openppo.cli.runner import run_cli
from openppo.ppo.config import PPOConfig

logger = logging.getLogger("openppo.train_ppo_ray")


def train(cfg: PPOConfig) -> None:
    # imported here, not at the top: `--help` and a bad flag need the config alone (transformers, datasets and the
    # trainer's modules took 5 s of a 6 s --help)
    from openppo.config.schema import to_dict
    from openppo.errors import headline
    from openppo.models.hf import load_tokenizer
    from openppo.ppo import launch
    from openppo.ppo.plan import make_plan
    from openppo.ppo.reporting import advice_text, advise, summary_table
    from openppo.ppo.rollout_archive import check_replay_dir
    from openppo.ppo.trainer import PPOTrainer
    from openppo.ppo.validate import validate_devices, validate_flags
    from openppo.rewards import build_reward_source
    from openppo.utils.hardware import host_memory_gib
    from openppo.utils.tracking import MetricsTracker, log_run_info, run_info

    for notice in validate_flags(cfg):  # everything that needs no device, before Ray starts
        logger.info("note: %s", notice)
    # The user's files first (cheap): a wrong path or key fails before the tokenizer loads, and everything
    # that reads the data is done before anything is written to --save_path.
    m = cfg.model
    reward_source = build_reward_source(
        m.remote_rm_url,
        default_reward=m.remote_rm_default_reward,
        timeout_s=m.remote_rm_timeout,
        max_retries=m.remote_rm_retries,
        func_timeout_s=m.reward_func_timeout,
    )
    if cfg.train.rollout_replay_dir:
        check_replay_dir(cfg.train.rollout_replay_dir)
    rows = launch.load_prompt_rows(cfg)
    routes = launch.teacher_routes(cfg, rows)
    eval_rows = launch.load_prompt_rows(cfg, eval=True) if cfg.data.eval_dataset else None
    tokenizer = load_tokenizer(cfg.model.pretrain, use_fast=not cfg.data.disable_fast_tokenizer)
    agent_episodes, agent_program = launch.load_agent(cfg, tokenizer)
    programmed = agent_program is not None  # its episodes take the prompts as chat messages
    prompts = launch.load_prompts(cfg, tokenizer, rows, keep_messages=programmed)
    eval_prompts = launch.load_prompts(cfg, tokenizer, eval_rows, programmed) if eval_rows is not None else None
    groups = None
    try:
        # The cluster's devices decide the run's, not this process's (a GPU-less head node under `ray job submit`)
        devices = launch.run_devices()
        logger.info(devices.describe())
        probe = launch.probe_devices(cfg, devices)
        launch.resolve_run_precision(cfg, probe)
        launch.resolve_attention(cfg, devices)
        launch.resolve_token_budget(cfg, probe, devices.on_gpu)
        for notice in validate_devices(cfg, devices.on_gpu):
            logger.info("note: %s", notice)
        eval_only = launch.evaluates_pretrain(cfg)
        # before any model loads (it reads the free RAM)
        kv_bytes = launch.kv_cache_bytes(cfg, devices.on_gpu, eval_only=eval_only)
        plan = make_plan(cfg, len(prompts))  # every derived number, once
        launch.check_layout_fits(cfg, plan, devices, eval_only=eval_only)
        launch.start_ray()  # joined already when the cluster is not this machine's own
        config = to_dict(cfg)
        log_run_info({**run_info(config, "train_ppo_ray"), "plan": plan.to_dict()}, cfg.ckpt.save_path)
        logger.info(plan.describe())
        logger.info("shared prompts (--share_prompt_in_group): %s", plan.shared_prompts)
        tracker = MetricsTracker.for_run(cfg, config, "ppo")
        if eval_only:
            logger.info("--eval_only of %s: only the engines and a reward model start", cfg.model.pretrain)
        try:
            restarts = engine_restarts = 0
            while True:
                groups = launch.build_groups(cfg, plan, reward_source, kv_bytes, devices.on_gpu, eval_only=eval_only)
                groups.engines.restarts = engine_restarts  # the run's count and bound go on over a restart
                source, scorer = launch.rollout_parts(cfg, groups, tokenizer, agent_episodes, agent_program)
                trainer = PPOTrainer(
                    cfg,
                    plan,
                    groups,
                    tokenizer,
                    prompts,
                    tracker,
                    source,
                    scorer,
                    eval_prompts=eval_prompts,
                    teacher_routes=routes,
                )
                try:
                    history = trainer.fit(restarted=restarts > 0)
                    break
                except Exception as exc:
                    if not launch.restartable(cfg, exc, restarts):
                        launch.raise_if_an_engine_died(groups, exc)  # the root cause, whatever failed first
                        raise
                    restarts += 1
                    logger.warning(
                        "%s; every group and engine starts again from the last committed checkpoint "
                        "(--max_rank_restarts: restart %d of at most %d)",
                        headline(exc),
                        restarts,
                        cfg.train.max_rank_restarts,
                    )
                    engine_restarts = groups.engines.restarts
                    launch.teardown(groups)
                    groups = None
            if cfg.data.eval_only:
                logger.info("--eval_only: evaluated; metrics.jsonl: %s", cfg.ckpt.save_path)
                return
            critic_dir = launch.critic_export_dir(cfg) if groups.critic is not None else None
            if cfg.ckpt.disable_final_save:
                logger.info("--disable_final_save: the trained models are not exported to %s", cfg.ckpt.save_path)
                critic_dir = None
            else:
                groups.actor.save_hf(cfg.ckpt.save_path, cfg.model.pretrain)
            if critic_dir is not None:
                groups.critic.save_hf(critic_dir, cfg.model.pretrain)
            summary = f"{summary_table(history)}\n\n{advice_text(advise(history, cfg, host_memory_gib()))}"
            logger.info("run summary\n%s", summary)
            (Path(cfg.ckpt.save_path) / "summary.txt").write_text(summary + "\n")
            where = f"{'' if cfg.ckpt.disable_final_save else 'trained actor, '}metrics.jsonl and rollouts.jsonl: "
            where += str(cfg.ckpt.save_path)
            if critic_dir is not None:
                where += f"; trained critic: {critic_dir}"
            if cfg.logging.use_tensorboard:
                where += f"; TensorBoard: {cfg.logging.use_tensorboard}"
            logger.info(where)
        finally:
            tracker.close()
    finally:
        launch.shutdown(groups)


def main(argv=None) -> int:
    return run_cli(train, PPOConfig, "openppo.cli.train_ppo_ray", __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
