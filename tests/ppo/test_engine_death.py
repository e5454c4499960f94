"""A vLLM engine killed mid-run stops the run within 2 minutes with an error that names the engine, its process
and its last log lines, and leaves the committed checkpoint intact. Real Ray + DeepSpeed + vLLM CPU, tiny model."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from openppo.strategy import checkpoint as ckpt
from openppo.tasks.arithmetic import make_rows, write_jsonl
from tests.cli.helpers import REPO, cli_env
from tests.model_cache import tiny_model_dir
from tests.processes import kill_tree

pytestmark = pytest.mark.slow
HERE = Path(__file__).parent
STOP_WITHIN_S = 120


def _args(prompts: Path, save: Path, ckpt_dir: Path) -> list[str]:
    return [
        "--pretrain",
        str(tiny_model_dir()),
        "--remote_rm_url",
        str(HERE / "label_reward.py"),
        "--prompt_data",
        str(prompts),
        "--input_key",
        "input",
        "--label_key",
        "label",
        "--apply_chat_template",
        "--advantage_estimator",
        "group_norm",
        "--n_samples_per_prompt",
        "2",
        "--rollout_batch_size",
        "2",
        "--train_batch_size",
        "4",
        "--micro_train_batch_size",
        "2",
        "--vllm_kv_cache_bytes",
        str(128 * 2**20),
        "--init_kl_coef",
        "0",
        "--generate_max_len",
        "8",
        "--prompt_max_len",
        "64",
        "--param_dtype",
        "fp32",
        "--zero_stage",
        "0",
        "--max_steps",
        "100",
        "--actor_learning_rate",
        "1e-4",
        "--save_steps",
        "1",
        "--save_path",
        str(save),
        "--ckpt_path",
        str(ckpt_dir),
    ]


def test_killed_engine_stops_the_run_and_names_it(tmp_path):
    prompts = write_jsonl([{**row, "label": "mixed"} for row in make_rows(64, seed=3)], tmp_path / "prompts.jsonl")
    ckpt_dir, log = tmp_path / "ckpt", tmp_path / "driver.log"
    tag = f"OPENPPO_ENGINE_DEATH_TEST={uuid.uuid4().hex}"
    env = {**cli_env(), tag.split("=")[0]: tag.split("=")[1]}
    cmd = [sys.executable, "-m", "openppo.cli.train_ppo_ray", *_args(prompts, tmp_path / "save", ckpt_dir)]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while ckpt.resolve(ckpt_dir) is None:  # a committed checkpoint first: it must survive the failure
            assert proc.poll() is None, log.read_text()[-6000:]
            assert time.monotonic() < deadline, log.read_text()[-6000:]
            time.sleep(0.05)
        engine_pid = int(re.search(r"vLLM engine 0: pid (\d+)", log.read_text()).group(1))
        os.kill(engine_pid, signal.SIGKILL)
        killed_at = time.monotonic()
        try:
            code = proc.wait(timeout=STOP_WITHIN_S + 60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the run did not stop after its engine died:\n{log.read_text()[-6000:]}")
        stopped_after = time.monotonic() - killed_at
    finally:
        kill_tree(proc, tag)
    text = log.read_text()
    assert code == 1, text[-6000:]
    assert stopped_after <= STOP_WITHIN_S, (stopped_after, text[-6000:])
    error = text[text.index("error: vLLM engine 0 (") :]
    assert f"pid {engine_pid}" in error.splitlines()[0] and "died" in error.splitlines()[0], error
    assert "--- last" in error and "lines of std" in error, error  # the engine's own last log lines
    assert "Traceback" not in error, error  # the diagnosis, not the driver's stack
    committed = ckpt.resolve(ckpt_dir)
    assert committed is not None and committed.step >= 1
    states = ckpt_dir / "actor" / ckpt.tag_for_step(committed.step) / "mp_rank_00_model_states.pt"
    assert "module" in torch.load(states, map_location="cpu", weights_only=False)  # loadable, not torn
    print(f"engine killed after step {committed.step} was committed; the run stopped {stopped_after:.1f} s later")
