"""The run plan against hand-computed values: steps, the rows of a rank's optimizer step, the LR schedule's length,
which roles run, and the old-log-prob pass."""

from __future__ import annotations

import json

import pytest

from openppo.config.schema import parse_config
from openppo.ppo.config import PPOConfig
from openppo.ppo.plan import make_plan


def _plan(flags: str, num_prompts: int):
    args = "--pretrain m --prompt_data p --remote_rm_url r.py".split() + flags.split()
    return make_plan(parse_config(PPOConfig, args, "t"), num_prompts)


def test_ppo_with_a_ring_and_a_critic():
    # 50 prompts, 4 a step: 12 steps an episode (2 prompts never drawn), 2 episodes, capped at 20 by --max_steps.
    # 4 prompts x 2 samples = 8 rows a step, --max_epochs 2, --train_batch_size 4: 4 optimizer steps an RL step.
    # actor: 4 ranks in rings of 2 -> 2 data-parallel ranks, 2 rows each per optimizer step.
    plan = _plan(
        "--rollout_batch_size 4 --n_samples_per_prompt 2 --train_batch_size 4 --max_epochs 2 --num_episodes 2 "
        "--max_steps 20 --actor_num_gpus_per_node 4 --critic_num_gpus_per_node 2 --ring_attn_size 2 "
        "--packing_samples --param_dtype bf16",
        num_prompts=50,
    )
    assert (plan.rl_steps, plan.steps_per_episode) == (20, 12)
    assert set(plan.roles) == {"actor", "reference", "critic"}  # gae, --init_kl_coef 0.01 by default
    actor, critic, ref = plan.roles["actor"], plan.roles["critic"], plan.roles["reference"]
    assert (actor.ranks, actor.replicas, actor.data_parallel, actor.rows_per_step) == (4, 2, 2, 2)
    assert actor.optimizer_steps == critic.optimizer_steps == 20 * 4
    assert (critic.ranks, critic.replicas, critic.data_parallel, critic.rows_per_step) == (2, 2, 1, 4)
    assert (ref.rows_per_step, ref.optimizer_steps) == (0, 0)  # frozen
    assert plan.engine_dtype == "bfloat16" and plan.balance and plan.old_logprob_pass
    assert "20 RL steps (12 an episode)" in plan.describe()
    assert json.loads(json.dumps(plan.to_dict()))["roles"]["actor"]["rows_per_step"] == 2  # logged with the run


def test_the_critics_own_epochs_and_the_engines_own_dtype():
    # as above, the critic's 3 passes over the 8 rows: 6 optimizer steps an RL step against the actor's 4
    ppo = "--rollout_batch_size 4 --n_samples_per_prompt 2 --train_batch_size 4 --max_epochs 2 --max_steps 20 "
    plan = _plan(ppo + "--critic.max_epochs 3 --param_dtype bf16 --vllm.dtype float32", num_prompts=80)
    assert (plan.roles["actor"].optimizer_steps, plan.roles["critic"].optimizer_steps) == (20 * 4, 20 * 6)
    assert plan.engine_dtype == "float32"  # the engines' own dtype; the trainer stays bf16


def test_force_on_policy_takes_one_step_per_batch():
    # 8 rows a step, --train_batch_size 4 would make 2 optimizer steps; Molt's --train.force_on_policy makes one, over
    # all of a rank's rows (2 actor ranks: 4 each), for the critic too, and pi_old is then the policy being trained
    ppo = "--rollout_batch_size 4 --n_samples_per_prompt 2 --train_batch_size 4 --max_steps 20 "
    plan = _plan(ppo + "--actor_num_gpus_per_node 2 --train.force_on_policy --param_dtype fp32", num_prompts=80)
    actor, critic = plan.roles["actor"], plan.roles["critic"]
    assert (actor.optimizer_steps, critic.optimizer_steps, actor.rows_per_step, critic.rows_per_step) == (20, 20, 4, 8)
    grpo = "--advantage_estimator group_norm --init_kl_coef 0 "
    assert not _plan(ppo + grpo + "--train.force_on_policy --param_dtype fp32", 80).old_logprob_pass
    assert _plan(ppo + grpo + "--param_dtype fp32", 80).old_logprob_pass  # two steps a batch
    # a rank's step takes every row it got, however many (an agent's sealed segments add rows)
    train = parse_config(PPOConfig, "--pretrain m --prompt_data p --train.force_on_policy".split(), "t").train
    assert train.step_rows(planned=4, rows=11) == 11 and train.step_rows(planned=4, rows=0) == 1  # (a range's step)
    assert parse_config(PPOConfig, "--pretrain m --prompt_data p".split(), "t").train.step_rows(4, 11) == 4


def test_one_on_policy_step_needs_no_old_log_prob_pass():
    # GRPO, no reference, the whole batch one optimizer step of one epoch: pi_old is the policy being trained
    grpo = "--advantage_estimator group_norm --rollout_batch_size 2 --n_samples_per_prompt 4 --param_dtype fp32 "
    plan = _plan(grpo + "--init_kl_coef 0 --train_batch_size 8", num_prompts=8)
    assert set(plan.roles) == {"actor"} and not plan.old_logprob_pass and not plan.balance
    assert plan.engine_dtype == "float32" and plan.rl_steps == 4 and plan.roles["actor"].optimizer_steps == 4
    assert _plan(grpo + "--init_kl_coef 0 --train_batch_size 8 --max_epochs 2", 8).old_logprob_pass  # 2nd epoch
    assert _plan(grpo + "--init_kl_coef 0 --train_batch_size 4", 8).old_logprob_pass  # 2 optimizer steps a batch
    assert _plan(grpo + "--train_batch_size 8", 8).old_logprob_pass  # a reference's KL is measured against pi_old


def test_tensor_parallel_actor_shares_rows_and_a_reward_model_runs():
    plan = _plan(
        "--ds_tensor_parallel_size 2 --actor_num_gpus_per_node 4 --rollout_batch_size 4 --train_batch_size 4 "
        "--reward_pretrain m --param_dtype fp16",
        num_prompts=4,
    )
    actor = plan.roles["actor"]
    assert (actor.tensor_parallel, actor.replicas, actor.data_parallel, actor.rows_per_step) == (2, 2, 2, 2)
    assert plan.roles["reward"].ranks == 1 and plan.engine_dtype == "float16"


@pytest.mark.parametrize(
    "flags,shared",
    [
        ("--advantage_estimator group_norm --n_samples_per_prompt 4 --packing_samples", True),
        ("--advantage_estimator rloo --n_samples_per_prompt 4 --packing_samples --use_dynamic_batch", True),
        ("--advantage_estimator group_norm --n_samples_per_prompt 4", False),  # padded rows
        ("--advantage_estimator gae --n_samples_per_prompt 4 --packing_samples", False),
        ("--advantage_estimator gae --n_samples_per_prompt 4 --packing_samples --share_prompt_in_group", True),
        (
            "--advantage_estimator group_norm --n_samples_per_prompt 4 --packing_samples --share_prompt_in_group off",
            False,
        ),
        ("--advantage_estimator reinforce --n_samples_per_prompt 1 --packing_samples --share_prompt_in_group", False),
        # a kernel of transformers' own would read the shared row's positions as one long sequence
        ("--advantage_estimator rloo --n_samples_per_prompt 4 --packing_samples --attn_implementation eager", False),
    ],
)
def test_shared_prompts_are_on_where_they_are_exact_and_pay(flags, shared):
    """--share_prompt_in_group auto: on for group estimators with several samples a prompt and packed rows; every
    model's slice of the plan carries the choice, and the plan says why in one line."""
    plan = _plan(f"--param_dtype fp32 --rollout_batch_size 4 --train_batch_size 16 --init_kl_coef 0 {flags}", 8)
    assert all(role.share_prompts == shared for role in plan.roles.values())
    assert plan.shared_prompts.startswith("on (" if shared else "off (") and "\n" not in plan.shared_prompts
