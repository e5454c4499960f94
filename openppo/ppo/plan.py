"""The run plan: every number train_ppo_ray derives from the flags, computed once, logged, and handed out in slices.

Built after validation and after the prompts are loaded (the step count depends on how many there are). The
controller reads the run's side (`rl_steps`, `old_logprob_pass`, ...); each model group gets only its `RolePlan`:
its ranks, how many of them share rows, the rows of one optimizer step on one rank and the optimizer steps of the
run. Nothing downstream recomputes these from the config.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from openppo.ppo.config import PPOConfig
from openppo.ppo.teachers import Teacher, parse_teachers
from openppo.ppo.validate import needs_critic_group, needs_reference, role_ranks

# vLLM's name for the trainer's (resolved) dtype: engine and trainer log-probs then compare
ENGINE_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@dataclass(frozen=True)
class RolePlan:
    """One model group's share of the plan."""

    name: str  # actor, critic, reference, reward, teacher0, teacher1, ...
    ranks: int  # --<role>_num_nodes x --<role>_num_gpus_per_node
    ring: int  # --ring_attn_size: consecutive ranks that split each packed row
    tensor_parallel: int  # --ds_tensor_parallel_size (actor only): consecutive ranks that split the weights
    rows_per_step: int  # rows of one optimizer step on one rank; 0 for a frozen model
    optimizer_steps: int  # optimizer steps over the run (the LR schedule's length); 0 for a frozen model
    share_prompts: bool = False  # --share_prompt_in_group: each group's prompt computed once
    model: str = ""  # the folder it loads, where the role does not say (a teacher's)

    @property
    def replicas(self) -> int:
        """Consecutive ranks that hold the same rows (a ring, a tensor-parallel group): one data-parallel rank."""
        return self.ring * self.tensor_parallel

    @property
    def data_parallel(self) -> int:
        return self.ranks // self.replicas


@dataclass(frozen=True)
class RunPlan:
    rl_steps: int  # RL steps of the run: the prompts' episodes, capped by --max_steps
    steps_per_episode: int
    engine_dtype: str  # vLLM's dtype
    old_logprob_pass: bool  # a separate forward scores pi_old (else the update's own log-probs, detached)
    balance: bool  # deal rows to ranks by tokens (packing or token budgets cost micro-batches by tokens)
    roles: dict[str, RolePlan]
    shared_prompts: str = "off"  # --share_prompt_in_group as resolved, with the reason (one log line)

    def describe(self) -> str:
        roles = "; ".join(
            f"{r.name} {r.ranks} rank(s)"
            + (f" ({r.data_parallel} data-parallel x {r.replicas} sharing rows)" if r.replicas > 1 else "")
            + (f", {r.rows_per_step} rows a step, {r.optimizer_steps} optimizer steps" if r.optimizer_steps else "")
            for r in self.roles.values()
        )
        return (
            f"run plan: {self.rl_steps} RL steps ({self.steps_per_episode} an episode), engines in "
            f"{self.engine_dtype}, old-log-prob pass {'on' if self.old_logprob_pass else 'off'}; {roles}"
        )

    def to_dict(self) -> dict:
        return asdict(self)


def make_plan(cfg: PPOConfig, num_prompts: int) -> RunPlan:
    """The plan of a validated config whose --param_dtype is resolved (`openppo.cli.runner` resolves auto)."""
    assert cfg.ds.param_dtype in ENGINE_DTYPES, f"--param_dtype {cfg.ds.param_dtype} must be resolved first"
    r, t = cfg.rollout, cfg.train
    steps_per_episode = num_prompts // r.rollout_batch_size
    rl_steps = steps_per_episode * t.num_episodes
    if t.max_steps > 0:
        rl_steps = min(rl_steps, t.max_steps)
    samples = r.rollout_batch_size * r.n_samples_per_prompt
    # No separate pi_old pass when the whole batch is one optimizer step of one epoch and no reference model runs:
    # pi_old is then the current policy, and the update's own log-probs, detached, are the old ones (ratio 1 with
    # the same gradient). Several steps or epochs move the policy before later micro-batches train, and a
    # reference's KL is measured against pi_old before the update: both need the pass.
    step_size = samples if t.force_on_policy else t.train_batch_size  # rows of one optimizer step
    one_step = t.max_epochs == 1 and samples == step_size

    share, why = shares_prompts(cfg)

    def role(name: str, flag: str, trained: bool, model: str = "") -> RolePlan:
        ranks = role_ranks(cfg, flag)
        tp = cfg.ds.ds_tensor_parallel_size if name == "actor" else 1
        data_parallel = ranks // (r.ring_attn_size * tp)
        return RolePlan(
            name=name,
            ranks=ranks,
            ring=r.ring_attn_size,
            tensor_parallel=tp,
            rows_per_step=step_size // data_parallel if trained else 0,
            optimizer_steps=max(1, rl_steps * samples * t.epochs(name) // step_size) if trained else 0,
            share_prompts=share,
            model=model,
        )

    roles = {"actor": role("actor", "actor", True)}
    if needs_reference(cfg):
        roles["reference"] = role("reference", "ref", False)
    if needs_critic_group(cfg):
        roles["critic"] = role("critic", "critic", True)
    if cfg.model.reward_pretrain:
        roles["reward"] = role("reward", "reward", False)
    teachers = parse_teachers(cfg.model.teacher_pretrain)
    for i, teacher in enumerate(teachers):
        roles[Teacher.role(i)] = role(Teacher.role(i), "teacher", False, teacher.path)
    return RunPlan(
        rl_steps=rl_steps,
        steps_per_episode=steps_per_episode,
        engine_dtype=cfg.vllm.vllm_dtype or ENGINE_DTYPES[cfg.ds.param_dtype],
        # a teacher's advantage is log pi_T - log pi_S with the trainer's pi_S, as exact as the teacher's log-probs
        # (and an endpoint agent's sealed segments are extra rows: more than one optimizer step per batch)
        old_logprob_pass=not one_step or needs_reference(cfg) or bool(teachers) or bool(r.agent_program),
        balance=r.packing_samples or r.use_dynamic_batch,
        roles=roles,
        shared_prompts=f"{'on' if share else 'off'} ({why})",
    )


def shares_prompts(cfg: PPOConfig) -> tuple[bool, str]:
    """--share_prompt_in_group resolved, and why: auto shares where it is exact and pays (module doc of
    openppo.models.row_layout): group estimators, several samples a prompt, packed rows, no ring."""
    r, estimator = cfg.rollout, cfg.algo.advantage_estimator
    if r.share_prompt_in_group == "off":
        return False, "--share_prompt_in_group off"
    if r.n_samples_per_prompt == 1:
        return False, "one sample a prompt"
    if r.share_prompt_in_group == "on":
        return True, "--share_prompt_in_group on"
    if estimator == "gae":
        return False, "--advantage_estimator gae (--share_prompt_in_group on to share anyway)"
    if not r.packing_samples:
        return False, "rows are padded (add --packing_samples)"
    if cfg.model.attn_implementation != "sdpa":
        return False, f"--attn_implementation {cfg.model.attn_implementation} cannot take a shared row (use sdpa)"
    if r.ring_attn_size > 1:
        return False, "--ring_attn_size splits rows over ranks"
    return True, f"{estimator}, {r.n_samples_per_prompt} samples a prompt, packed rows"
