"""train_ppo_ray on a two-node Ray cluster (tests/two_nodes.py: each node has an IP address of its own, in its own
network namespace): GRPO with one actor rank on each node (--placement_strategy STRICT_SPREAD), ZeRO-3 over gloo
across the link, the engine on one node, and the weight sync reaching it exactly wherever it landed."""

from __future__ import annotations

import re

import pytest

from openppo.tasks.arithmetic import make_rows, write_jsonl
from tests import two_nodes
from tests.cli.helpers import REPO, cli_env, read_metrics, run_cli, series
from tests.model_cache import tiny_model_dir

pytestmark = [pytest.mark.slow, pytest.mark.skipif(two_nodes.why_not() is not None, reason=str(two_nodes.why_not()))]

SYNC_CHECKED = "--vllm_sync_check: 1 engine(s) compute with the trainer's weights: "


@pytest.fixture(scope="module")
def cluster():
    with two_nodes.two_nodes(cli_env(), head_cpus=4, worker_cpus=4) as nodes:
        yield nodes


def _run(cluster, prompts, save, ckpt, steps: int, *extra: str):
    return run_cli(
        "train_ppo_ray",
        [
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
        ],
        nproc=1,
        timeout=600,
        ray_address=cluster.address,
    )


def test_grpo_with_a_rank_on_each_node_then_resume(cluster, tmp_path):
    """Two steps with --vllm_sync_check, a checkpoint after each in a folder both nodes see, then a run that resumes
    from it for a third step: the metrics hold each step once."""
    prompts = write_jsonl(make_rows(16, seed=1), tmp_path / "prompts.jsonl")
    save, ckpt = tmp_path / "out", tmp_path / "ckpt"
    proc = _run(cluster, prompts, save, ckpt, 2, "--vllm_sync_check")
    placed = re.search(r"placement \(STRICT_SPREAD\): actor (.*?); engines (.*)", proc.stdout)
    assert placed, proc.stdout[-3000:]
    head, worker = cluster.head_ip, cluster.worker_ip
    # ZeRO-3's collectives cross the link; the engines spread over both nodes, so the broadcast from rank 0 reaches
    # an engine on the other node
    assert placed.group(1) in (f"{head} [0], {worker} [1]", f"{worker} [0], {head} [1]"), placed.group(0)
    assert placed.group(2) in (f"{head} [0], {worker} [1]", f"{worker} [0], {head} [1]"), placed.group(0)
    assert "engine(s) 0,1 via gloo broadcast" in proc.stdout
    assert proc.stdout.count(SYNC_CHECKED.replace("1 engine", "2 engine")) == 1
    records = read_metrics(save)
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["rollout/logprob_diff"] < 1e-4 for r in records), series(records, "rollout/logprob_diff")
    resumed = _run(cluster, prompts, save, ckpt, 3, "--load_checkpoint")
    assert "resumed from" in resumed.stdout and "at step 2" in resumed.stdout, resumed.stdout[-3000:]
    records = read_metrics(save)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[2]["rollout/logprob_diff"] < 1e-4
