"""--share_prompt_in_group end to end: a GRPO step with shared prompts gives the numbers of the same step without.

Real Ray + DeepSpeed (ZeRO-0, an actor and a reference rank for the k3 KL loss) + vLLM on CPU, the tiny fp32 model,
packed rows under a token budget; --full_determinism makes every run draw the same samples. Two epochs over the
batch (each one optimizer step over all rows): the second is off the first's update, so its policy loss and KL loss
(exact token-means over the step) carry the shared update's gradient. (train/approx_kl is a mean of micro-batch
means, so it moves with the micro-batch split, which sharing changes under a token budget: not compared.)

The run shares its prompts in the old-log-prob, reference and update forwards; its step-1 metrics must equal, to
1e-5 relative, those of the same run without sharing, recorded in tests/assets/shared_prompts_step1.json (one run
instead of two: the suite's time is counted); the engine-trainer log-prob gap, fp32 rounding, is bounded.
Re-record (without sharing) after a change meant to move the numbers, as the golden trace:

    OPENPPO_WRITE_GOLDEN=1 .venv/bin/python -m pytest tests/ppo/test_shared_prompts_run.py
"""

from __future__ import annotations

import json
import os

import pytest

from openppo.tasks.arithmetic import make_rows, write_jsonl
from tests.cli.helpers import REPO, read_metrics, run_cli
from tests.model_cache import tiny_model_dir

pytestmark = pytest.mark.slow
ASSET = REPO / "tests" / "assets" / "shared_prompts_step1.json"
COMPARED = (
    "train/reward",
    "train/policy_loss",
    "train/kl_loss",
    "train/kl",
    "train/entropy",
    "train/response_length",
)
# The engine and the trainer agree to fp32 rounding with or without sharing; the size of that rounding (4.4e-7 here)
# moves with the CPU's kernels (6.5e-7 under AVX2 caps; 2.3e-7 drift in tests/ppo/test_golden_trace.py), so it is
# bounded, not compared with a stored value.
EXACT = 1e-5


def test_grpo_step_is_the_same_with_shared_prompts(tmp_path):
    prompts = write_jsonl([{**row, "label": "mixed"} for row in make_rows(8, seed=2)], tmp_path / "prompts.jsonl")
    write = os.environ.get("OPENPPO_WRITE_GOLDEN") == "1"
    share = "off" if write else "on"
    save = tmp_path / "out"
    flags = (
        f"--pretrain {tiny_model_dir()} --prompt_data {prompts} --input_key input --label_key label "
        f"--apply_chat_template --remote_rm_url {REPO / 'tests/ppo/label_reward.py'} "
        "--advantage_estimator group_norm --n_samples_per_prompt 4 --rollout_batch_size 4 "
        "--train_batch_size 16 --micro_rollout_batch_size 16 --actor_num_gpus_per_node 1 "
        "--ref_num_gpus_per_node 1 --vllm_num_engines 1 --vllm_kv_cache_bytes 268435456 --generate_max_len 16 "
        "--prompt_max_len 64 --zero_stage 0 --param_dtype fp32 --max_steps 1 --max_epochs 2 --actor_learning_rate 1e-3 "
        "--init_kl_coef 0.01 --use_kl_loss --kl_estimator k3 --packing_samples --use_dynamic_batch "
        f"--train_max_tokens_per_gpu 200 --full_determinism --save_path {save} --share_prompt_in_group {share}"
    )
    proc = run_cli("train_ppo_ray", flags.split(), nproc=1, timeout=600)
    [metrics] = read_metrics(save)
    if write:
        ASSET.write_text(json.dumps({key: metrics[key] for key in COMPARED}, indent=1) + "\n")
        return
    log = proc.stdout + proc.stderr
    assert "shared prompts (--share_prompt_in_group): on (--share_prompt_in_group on)" in log
    expected = json.loads(ASSET.read_text())
    for key in COMPARED:
        assert metrics[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), key
    assert metrics["rollout/logprob_diff"] < EXACT
    # the prompts (about 23 tokens) are most of each row: 4 rows of a prompt computed it once
    assert metrics["perf/actor_shared_prompt_share"] > 0.3
