"""train_ppo_ray on a two-node Ray cluster (tests/two_nodes.py: each node has an IP address of its own, in its own
network namespace): GRPO with one actor rank on each node (--placement_strategy STRICT_SPREAD), ZeRO-3 over gloo
across the link, an engine on each node and the weight sync reaching both exactly, in a job submitted with `ray job
submit`, stopped, and resumed from its checkpoint by the next job."""

from __future__ import annotations

import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from openppo.strategy import checkpoint as ckpt
from openppo.tasks.arithmetic import make_rows, write_jsonl
from tests import two_nodes
from tests.cli.helpers import REPO, cli_env, read_metrics, series
from tests.engine_kills import engine_pid, kill_while_generating
from tests.model_cache import tiny_model_dir

pytestmark = [pytest.mark.slow, pytest.mark.skipif(two_nodes.why_not() is not None, reason=str(two_nodes.why_not()))]

SYNC_CHECKED = "--vllm_sync_check: 2 engine(s) compute with the trainer's weights: "


@pytest.fixture(scope="module")
def cluster():
    with two_nodes.two_nodes(cli_env(), head_cpus=4, worker_cpus=4) as nodes:
        yield nodes


def _args(prompts, save, ckpt, steps: int, *extra: str) -> list[str]:
    return [
        "--pretrain",
        str(tiny_model_dir()),
        "--remote_rm_url",
        str(REPO / "examples/reward_funcs/arithmetic.py"),
        "--prompt_data",
        str(prompts),
        "--save_path",
        str(save),
        "--ckpt_path",
        str(ckpt),
        "--max_steps",
        str(steps),
        *(
            "--input_key input --label_key label --apply_chat_template --advantage_estimator group_norm "
            "--n_samples_per_prompt 4 --rollout_batch_size 4 --train_batch_size 8 --micro_train_batch_size 2 "
            "--micro_rollout_batch_size 4 --actor_num_gpus_per_node 2 --placement_strategy STRICT_SPREAD "
            "--vllm_num_engines 2 --init_kl_coef 0 --generate_max_len 8 --prompt_max_len 64 --zero_stage 3 "
            "--param_dtype fp32 --actor_learning_rate 1e-4 --save_steps 1"
        ).split(),
        *extra,
    ]


def _submit(cluster, args: list[str], *options: str) -> str:
    """`ray job submit` to the head's dashboard, as a user submits a job (the driver runs on the head node): its
    output until the job ends, or with --no-wait its submission line."""
    ray = str(Path(sys.executable).parent / "ray")
    cmd = [ray, "job", "submit", "--address", cluster.dashboard, *options, "--", sys.executable, "-m"]
    cmd += ["openppo.cli.train_ppo_ray", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=cli_env(), cwd=REPO)
    assert proc.returncode == 0, f"{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def test_grpo_with_a_rank_on_each_node_killed_then_resumed(cluster, tmp_path):
    """A job submitted with `ray job submit` runs steps with --vllm_sync_check and a checkpoint after each in a folder
    both nodes see. After step 1 the engine on the worker node is killed and replaced. The job is stopped (`ray job
    stop`: SIGTERM, then SIGKILL) once step 2 is committed, and a second job resumes from the checkpoint to step 4:
    the metrics hold each step once, and every step's samples have the trainer's log-probs."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    prompts = write_jsonl(make_rows(16, seed=1), tmp_path / "prompts.jsonl")
    save, ckpt_dir = tmp_path / "out", tmp_path / "ckpt"
    job = f"openppo-{uuid.uuid4().hex[:8]}"
    _submit(cluster, _args(prompts, save, ckpt_dir, 4, "--vllm_sync_check"), "--no-wait", "--submission-id", job)
    client = JobSubmissionClient(cluster.dashboard)
    deadline = time.monotonic() + 600
    while not ckpt.marker_path(ckpt_dir, 1).exists():
        assert not client.get_job_status(job).is_terminal(), client.get_job_logs(job)[-6000:]
        assert time.monotonic() < deadline, client.get_job_logs(job)[-6000:]
        time.sleep(0.2)
    # the engine on the worker node dies (its process killed, as soon as it is busy: generating 8 tokens, or
    # receiving a weight sync): a new one takes its place, joins a new broadcast group across the link and gets the
    # current weights
    where = dict(re.findall(r"vLLM engine (\d): pid \d+ on (\S+)", client.get_job_logs(job)))
    remote = next(int(i) for i, ip in where.items() if ip == cluster.worker_ip)
    killed = kill_while_generating(engine_pid(client.get_job_logs(job), remote), busy_s=0.02)
    while not ckpt.marker_path(ckpt_dir, 2).exists() or f"vLLM engine {remote}: restarted" not in (
        logs := client.get_job_logs(job)
    ):
        status = client.get_job_status(job)
        assert not status.is_terminal(), f"{status}: {client.get_job_logs(job)[-6000:]}"
        assert time.monotonic() < deadline, client.get_job_logs(job)[-6000:]
        time.sleep(1)
    client.stop_job(job)
    while not client.get_job_status(job).is_terminal():
        assert time.monotonic() < deadline, client.get_job_logs(job)[-6000:]
        time.sleep(1)
    assert client.get_job_status(job) == JobStatus.STOPPED
    logs = client.get_job_logs(job)
    restart = next(line for line in logs.splitlines() if "(restart 1 of at most 3)" in line)
    assert f"vLLM engine {remote} (pid {killed} on {cluster.worker_ip})" in restart, restart
    # (the driver's own lines: Ray folds an actor's repeated lines into one)
    assert logs.count("weight sync: engine(s) 0,1 via gloo broadcast") == 2, logs[-6000:]
    placed = re.search(r"placement \(STRICT_SPREAD\): actor (.*?); engines (.*)", logs)
    assert placed, logs[-3000:]
    head, worker = cluster.head_ip, cluster.worker_ip
    # ZeRO-3's collectives cross the link; the engines spread over both nodes, so the broadcast from rank 0 reaches
    # an engine on the other node
    assert placed.group(1) in (f"{head} [0], {worker} [1]", f"{worker} [0], {head} [1]"), placed.group(0)
    assert placed.group(2) in (f"{head} [0], {worker} [1]", f"{worker} [0], {head} [1]"), placed.group(0)
    assert logs.count(SYNC_CHECKED) == 1
    committed = ckpt.resolve(ckpt_dir)
    assert committed is not None and committed.step in (2, 3), committed
    resumed = _submit(cluster, _args(prompts, save, ckpt_dir, 4, "--load_checkpoint"))
    assert f"at step {committed.step}" in resumed and "succeeded" in resumed, resumed[-3000:]
    records = read_metrics(save)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(r["rollout/logprob_diff"] < 1e-4 for r in records), series(records, "rollout/logprob_diff")
