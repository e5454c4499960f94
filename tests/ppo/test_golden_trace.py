"""The golden trace: 3 steps of GRPO and 3 steps of PPO, number for number, against tests/assets/golden_trace.json;
and a resume from the GRPO run's step 2 that repeats its step 3 exactly (--full_determinism).

The trace is the safety net of refactors: a change that reorders, drops or rescales anything a step computes shows
as a moved number. Both runs are the real stack (Ray, DeepSpeed ZeRO-0, one vLLM engine) on the tiny fp32 model,
1 actor rank, with --full_determinism (the engines' sampling is seeded per generation round from --seed and the
prompt position), so the same code gives the same samples and numbers on every run on one machine.

- GRPO: group_norm advantages, 4 samples per prompt, a reference for the k3 KL loss whose coefficient adapts every
  step (--kl_target), 2 optimizer steps per batch (the second off-policy: clip ratio and approx KL move), a
  parity reward (tests/ppo/label_reward.py). It saves every step, for the resume test.
- PPO: gae with a critic, a reward model and a reference (KL penalty in the reward), 2 optimizer steps per batch.
  It saves every step and, after step 1, loses the ranks of its critic, reference and reward model at once
  (SIGKILL): with --max_rank_restarts the job resumes from its checkpoint by itself, so its trace is also the proof
  that such a resume neither loses nor repeats anything.

Tolerance (`TOLERANCE`), from measurements on an AMD EPYC (AVX512_BF16): repeated runs differ by 0; the same runs
with AVX2 kernels (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2, other fp32
blocking) drew the same samples and moved every number by at most 2.3e-7 absolute (the vLLM-trainer log-prob gap,
itself ~5e-7) and 1.7e-4 relative (a policy loss of 5.6e-5). A sampled token that flipped under other rounding
would change a step's reward discretely and fail loudly.

To re-record after a change meant to move the numbers, run with OPENPPO_WRITE_GOLDEN=1 and say why in the commit:

    OPENPPO_WRITE_GOLDEN=1 .venv/bin/python -m pytest tests/ppo/test_golden_trace.py -k trace
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
from pathlib import Path

import pytest

from openppo.strategy import checkpoint as ckpt
from openppo.tasks.arithmetic import make_rows, write_jsonl
from tests.cli.helpers import REPO, BackgroundRun, read_metrics, run_cli
from tests.model_cache import tiny_model_dir

pytestmark = pytest.mark.slow
ASSET = REPO / "tests" / "assets" / "golden_trace.json"
# The trace's names -> the metric each is read from. After a rename only the right-hand side changes.
TRACED = {
    "reward": "train/reward",
    "policy_loss": "train/policy_loss",
    "value_loss": "train/value_loss",
    "kl": "train/kl",
    "kl_coef": "train/kl_coef",
    "clip_ratio": "train/clip_ratio",
    "entropy": "train/entropy",
    "logprob_diff": "rollout/logprob_diff",
    "approx_kl": "train/approx_kl",
    "response_length": "train/response_length",
    "advantage_abs": "train/advantage_abs",
}
TOLERANCE = dict(rel=1e-3, abs=1e-6)

COMMON = [
    "--label_key",
    "label",
    "--input_key",
    "input",
    "--apply_chat_template",
    "--rollout_batch_size",
    "4",
    "--micro_rollout_batch_size",
    "8",
    "--actor_num_gpus_per_node",
    "1",
    "--vllm_num_engines",
    "1",
    "--vllm_kv_cache_bytes",
    str(128 * 2**20),
    "--generate_max_len",
    "12",
    "--prompt_max_len",
    "64",
    "--zero_stage",
    "0",
    "--param_dtype",
    "fp32",
    "--max_steps",
    "3",
    "--actor_learning_rate",
    "1e-3",
    "--lr_warmup_ratio",
    "0",
    "--seed",
    "11",
    "--full_determinism",
]
RUNS = {
    "grpo": [
        "--remote_rm_url",
        str(REPO / "tests/ppo/label_reward.py"),
        "--advantage_estimator",
        "group_norm",
        "--n_samples_per_prompt",
        "4",
        "--train_batch_size",
        "8",
        "--micro_train_batch_size",
        "4",
        "--init_kl_coef",
        "0.01",
        "--use_kl_loss",
        "--kl_estimator",
        "k3",
        "--kl_target",
        "0.5",
        "--kl_horizon",
        "10",
        "--save_steps",
        "1",
    ],
    "ppo": [
        "--reward_pretrain",
        str(tiny_model_dir()),
        "--advantage_estimator",
        "gae",
        "--n_samples_per_prompt",
        "2",
        "--train_batch_size",
        "4",
        "--micro_train_batch_size",
        "2",
        "--init_kl_coef",
        "0.01",
        "--critic_learning_rate",
        "1e-3",
    ],
}


def _run(algo: str, tmp: Path, extra: list[str] = ()) -> tuple[Path, str]:
    # label "mixed": rewards 0.25/0.75 by response parity (label_reward.py), so GRPO's advantages are not zero
    prompts = write_jsonl([{**row, "label": "mixed"} for row in make_rows(12, seed=21)], tmp / "prompts.jsonl")
    save = tmp / "out"
    proc = run_cli(
        "train_ppo_ray",
        ["--pretrain", str(tiny_model_dir()), "--prompt_data", str(prompts), "--save_path", str(save)]
        + COMMON
        + RUNS[algo]
        + list(extra),
        nproc=1,
        timeout=600,
    )
    return save, proc.stdout + proc.stderr


# The PPO run loses a rank of each of these groups at once, as when the node that holds them is lost
LOST = ("critic", "reference", "reward")


def _run_losing_ranks(tmp: Path) -> Path:
    """The PPO golden run with a checkpoint after every step and --max_rank_restarts 1. Once step 1 is committed, its
    critic, reference and reward model ranks are SIGKILLed together: the first of them that step 2 calls is noticed,
    and the job resumes from step 1's checkpoint by itself. Its log is driver.log beside the save folder. (One
    restart: each costs what a start costs, about 48 s of this run on a 2-core box.)"""
    from tests import ray_cluster

    prompts = write_jsonl([{**row, "label": "mixed"} for row in make_rows(12, seed=21)], tmp / "prompts.jsonl")
    save, ckpt_dir = tmp / "out", tmp / "ckpt"
    args = ["--pretrain", str(tiny_model_dir()), "--prompt_data", str(prompts), "--save_path", str(save)]
    args += COMMON + RUNS["ppo"] + ["--save_steps", "1", "--ckpt_path", str(ckpt_dir), "--max_rank_restarts", "1"]
    run = BackgroundRun("train_ppo_ray", args, tmp / "driver.log", save=save, ray_address=ray_cluster.address())
    try:
        run.wait_for("step 1's checkpoint", lambda: ckpt.marker_path(ckpt_dir, 1).exists())
        for group in LOST:
            os.kill(_rank_pid(run.text(), group), signal.SIGKILL)
        code = run.proc.wait(timeout=600)
    finally:
        run.close()
    assert code == 0, run.text()[-6000:]
    return save


def _rank_pid(log: str, group: str) -> int:
    """The process of rank 0 of `group` in the run's first start."""
    return int(re.search(rf"{group} ranks: 0 pid (\d+) ", log).group(1))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """The save folder of each golden run (run once for the module)."""
    return {
        "grpo": _run("grpo", tmp_path_factory.mktemp("grpo"))[0],
        "ppo": _run_losing_ranks(tmp_path_factory.mktemp("ppo")),
    }


def _trace(records: list[dict]) -> list[dict[str, float]]:
    return [{name: r[metric] for name, metric in TRACED.items() if metric in r} for r in records]


@pytest.mark.parametrize("algo", list(RUNS))
def test_steps_repeat_the_golden_trace(runs, algo):
    trace = _trace(read_metrics(runs[algo]))
    assert len(trace) == 3
    if os.environ.get("OPENPPO_WRITE_GOLDEN"):
        golden = json.loads(ASSET.read_text()) if ASSET.exists() else {}
        golden[algo] = trace
        ASSET.parent.mkdir(exist_ok=True)
        ASSET.write_text(json.dumps(golden, indent=1, sort_keys=True) + "\n")
        pytest.skip(f"wrote the {algo} trace to {ASSET.relative_to(REPO)}")
    expected = json.loads(ASSET.read_text())[algo]
    for step, (got, want) in enumerate(zip(trace, expected), start=1):
        assert set(got) == set(want), (step, sorted(set(got) ^ set(want)))
        for name, value in want.items():
            assert got[name] == pytest.approx(value, **TOLERANCE), (algo, step, name, got[name], value)
    # the numbers move from step to step: the policy learns, the KL coefficient adapts
    assert trace[0]["policy_loss"] != trace[2]["policy_loss"]
    if algo == "grpo":
        assert len({r["kl_coef"] for r in trace}) == 3 and trace[0]["clip_ratio"] > 0


def test_resume_with_full_determinism_repeats_step_3(runs, tmp_path):
    """--full_determinism: resumed from step 2 of the GRPO run, step 3 is the unbroken run's, number for number.

    The trainer's state is restored bitwise (tests/ppo/test_resume_state.py), the adaptive KL coefficient with it,
    and the engines are reseeded from --seed and the prompt position, which the resume restores. Without the flag
    the engines' RNG would restart from --seed in the new process and step 3 would draw other samples."""
    unbroken = runs["grpo"]
    ckpt_dir = shutil.copytree(unbroken / "checkpoints", tmp_path / "ckpt")
    ckpt.marker_path(ckpt_dir, 3).unlink()  # step 3 was never saved, as far as a resume can tell
    resumed, log = _run("grpo", tmp_path, ["--load_checkpoint", "--ckpt_path", str(ckpt_dir)])
    assert f"resumed from {ckpt_dir} at step 2" in log
    whole, again = read_metrics(unbroken), read_metrics(resumed)
    assert [r["step"] for r in again] == [3]
    compared = [metric for metric in TRACED.values() if metric in whole[2]]
    assert {k: whole[2][k] for k in compared} == {k: again[0][k] for k in compared}, (whole[2], again[0])


def test_ppo_outlives_its_lost_critic_reference_and_reward_ranks(runs):
    """--max_rank_restarts: the lost ranks stop the step they were in, every group and engine starts again and the
    job resumes from the last committed checkpoint by itself, with one warning naming the group, rank and process
    that was noticed first. The metrics hold each step once, and (test_steps_repeat_the_golden_trace) their numbers
    are the unbroken run's."""
    log = (runs["ppo"].parent / "driver.log").read_text()
    [lost] = [line for line in log.splitlines() if "(--max_rank_restarts: restart" in line]
    group = re.search(r"worker group '(\w+)' rank 0 ", lost).group(1)
    assert group in LOST, lost
    assert f"pid {_rank_pid(log, group)} on " in lost, lost
    assert re.search(r"\) died in '\w+'; every group and engine starts again", lost), lost  # the headline only
    assert "(--max_rank_restarts: restart 1 of at most 1)" in lost, lost
    assert re.findall(r"resumed from \S+ at step (\d+)", log) == ["1"], log[-6000:]
    assert [r["step"] for r in read_metrics(runs["ppo"])] == [1, 2, 3]
