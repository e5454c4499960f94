"""Distillation's pieces without Ray: teacher names, routing, the step's advantages and metrics against hand values,
and how teachers enter the plan and the placement (openppo/ppo/teachers.py, plan.py, colocation.py)."""

from __future__ import annotations

import math

import pytest
import torch

from openppo.config.schema import parse_config
from openppo.errors import UserError
from openppo.ppo.colocation import colocation_pools, device_demand
from openppo.ppo.config import PPOConfig
from openppo.ppo.plan import make_plan
from openppo.ppo.teachers import Teacher, distill_step, parse_teachers, route, rows_for_ranks, teacher_rows
from tests.cli.helpers import REPO
from tests.model_cache import tiny_model_dir


def test_teachers_are_named_by_name_or_folder_and_names_must_differ():
    teachers = parse_teachers(["math=/m/qwen-math", "/models/coder/", "x=y=z"])
    assert teachers == [Teacher("math", "/m/qwen-math"), Teacher("coder", "/models/coder/"), Teacher("x", "y=z")]
    assert Teacher.role(1) == "teacher1"
    with pytest.raises(UserError, match="two teachers are named 'a'"):
        parse_teachers(["a=/x", "/y/a"])
    with pytest.raises(UserError, match="NAME=PATH"):
        parse_teachers(["=/x"])


def test_rows_are_routed_by_name_or_position():
    teachers = parse_teachers(["math=/a", "code=/b"])
    assert route(["code", "math", " 1", 0], teachers, "task") == [1, 0, 1, 0]
    assert route(None, teachers[:1], None) is None  # one teacher: every row
    with pytest.raises(UserError, match=r"--teacher_key task: row 2 names teacher 'poetry'"):
        route(["code", "math", "poetry"], teachers, "task")
    with pytest.raises(UserError, match="add --teacher_key"):
        route(None, teachers, None)
    # batch rows -> each teacher's rows, through the rows' dataset indices (Sample.group)
    rows = teacher_rows(torch.tensor([3, 3, 0, 1]), [1, 0, 1, 0], 2)
    assert [r.tolist() for r in rows] == [[0, 1, 3], [2]]
    assert [r.tolist() for r in teacher_rows(torch.tensor([5, 2]), None, 1)] == [[0, 1]]
    # a teacher's share smaller than its ranks: repeated so that each rank gets a row, its own rows first
    assert rows_for_ranks(torch.tensor([7]), 4).tolist() == [7, 7, 7, 7]
    assert rows_for_ranks(torch.tensor([2, 5]), 3).tolist() == [2, 5, 2]
    assert rows_for_ranks(torch.tensor([1, 2, 3]), 2).tolist() == [1, 2, 3]


def test_step_advantage_and_metrics_by_hand():
    # 2 rows x 3 positions; row 0 scores positions 1-2, row 1 positions 0-1; padding holds -inf
    mask = torch.tensor([[0, 1, 1], [1, 1, 0]])
    teacher = torch.tensor([[-math.inf, -0.1, -2.0], [-0.5, -1.0, -math.inf]])
    student = torch.tensor([[-math.inf, -0.7, -0.2], [-0.6, -0.3, -math.inf]])
    task = torch.tensor([[0.0, 1.0, 1.0], [-2.0, -2.0, 0.0]])
    rows = [torch.tensor([0]), torch.tensor([1])]
    adv, metrics = distill_step(teacher, student, mask, task, 0.5, rows, ["a", "b"])
    expected = torch.tensor([[0.0, 0.6 + 0.5, -1.8 + 0.5], [0.1 - 1.0, -0.7 - 1.0, 0.0]])
    torch.testing.assert_close(adv, expected)
    # teacher_kl: mean over scored tokens of log pi_S - log pi_T
    assert metrics["train/teacher_kl"] == pytest.approx((-0.6 + 1.8 - 0.1 + 0.7) / 4)
    assert metrics["train/teacher_kl/a"] == pytest.approx((-0.6 + 1.8) / 2)
    assert metrics["train/teacher_kl/b"] == pytest.approx((-0.1 + 0.7) / 2)
    # one teacher: no per-teacher split; coefficient 0: the teacher's term alone
    adv0, metrics0 = distill_step(teacher, student, mask, task, 0.0, rows[:1], ["a"])
    assert set(metrics0) == {"train/teacher_kl"}
    torch.testing.assert_close(adv0, torch.where(mask.bool(), teacher - student, torch.zeros(2, 3)))


def _cfg(*extra: str) -> PPOConfig:
    model = str(tiny_model_dir())
    argv = ["--pretrain", model, "--prompt_data", "x.jsonl", "--advantage_estimator", "group_norm"]
    argv += ["--n_samples_per_prompt", "2", "--rollout_batch_size", "4", "--train_batch_size", "8", "--init_kl_coef"]
    argv += ["0", "--actor_num_gpus_per_node", "2", "--param_dtype", "fp32", "--teacher_pretrain"]
    argv += [f"a={model}", f"b={model}", *extra]
    return parse_config(PPOConfig, argv, "train_ppo_ray")


def test_each_teacher_is_a_forward_group_of_the_plan():
    plan = make_plan(_cfg("--teacher_num_gpus_per_node", "2"), 8)
    assert [n for n in plan.roles] == ["actor", "teacher0", "teacher1"]
    t0 = plan.roles["teacher0"]
    assert (t0.ranks, t0.optimizer_steps, t0.model) == (2, 0, str(tiny_model_dir()))
    # one on-policy optimizer step a batch would skip the old-log-prob pass; a teacher needs the trainer's pi_S
    assert plan.old_logprob_pass
    without = _cfg()
    without.model.teacher_pretrain = []
    assert not make_plan(without, 8).old_logprob_pass


def test_teachers_take_devices_of_their_own_or_the_actors():
    cfg = _cfg()
    demand = device_demand(cfg, {"actor": 2, "teacher0": 1, "teacher1": 1}, on_gpu=True)
    assert [(d.what.split(" ")[0], d.count) for d in demand] == [
        ("actor", 2),
        ("teacher0", 1),
        ("teacher1", 1),
        ("vLLM", 1),
    ]
    assert "--teacher_num_nodes x --teacher_num_gpus_per_node" in demand[1].what
    cfg.resources.colocate_all_models = True
    (pool,) = colocation_pools(cfg, {"actor", "teacher0", "teacher1", "engines"})
    assert pool.members == ("actor", "engines", "teacher0", "teacher1") and pool.bundles == 2


def test_notices_name_what_distillation_leaves_without_effect():
    from openppo.ppo.validate import validate_flags

    rewarded = validate_flags(_cfg("--teacher_key", "task", "--remote_rm_url", str(REPO / "tests/ppo/label_reward.py")))
    assert any("--distill_task_coef 0: the task reward is logged" in n for n in rewarded), rewarded
    alone = validate_flags(_cfg("--teacher_key", "task", "--eval_dataset", "e.jsonl"))
    assert any("--eval_dataset: pass@k counts rewards" in n for n in alone), alone
    none = _cfg("--distill_task_coef", "0.5")
    none.model.teacher_pretrain = []
    none.model.remote_rm_url = str(REPO / "tests/ppo/label_reward.py")
    assert any("--distill_task_coef has no effect without --teacher_pretrain" in n for n in validate_flags(none))
