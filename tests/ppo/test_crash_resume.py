"""A driver killed with SIGKILL in the middle of a checkpoint save resumes at the last committed step, ignoring the
half-written folder (and a hand-made truncated marker and corrupt tag), and the steps after the resume draw the same
prompts as the unbroken run. The resume writes into the crashed run's --save_path: its logs then hold each step once.
Real Ray + DeepSpeed (ZeRO-2) + vLLM CPU, 1 actor rank, 1 engine, tiny model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from openppo.ppo.collector import PromptStream
from openppo.strategy import checkpoint as ckpt
from openppo.tasks.arithmetic import make_rows, write_jsonl
from tests.cli.helpers import REPO, cli_env, read_metrics, run_cli
from tests.model_cache import tiny_model_dir
from tests.processes import kill_tree

pytestmark = pytest.mark.slow
HERE = Path(__file__).parent
NUM_PROMPTS, ROLLOUT_BATCH, MAX_STEPS, SEED = 16, 2, 5, 11
KILL_AT = 3  # the driver is killed once the save of this step has begun


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
        str(ROLLOUT_BATCH),
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
        "2",
        "--max_steps",
        str(MAX_STEPS),
        "--actor_learning_rate",
        "1e-4",
        "--seed",
        str(SEED),
        "--save_steps",
        "1",
        "--max_ckpt_num",
        "2",
        "--save_path",
        str(save),
        "--ckpt_path",
        str(ckpt_dir),
    ]


def _rollouts(save: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (save / "rollouts.jsonl").read_text().splitlines())}


def _expected_prompts() -> dict[int, list[int]]:
    """Per step, the prompt indices an unbroken run draws (one seeded permutation per episode)."""
    stream = PromptStream(NUM_PROMPTS, rollout_batch_size=ROLLOUT_BATCH, num_episodes=1, seed=SEED)
    return {step: stream.take(ROLLOUT_BATCH) for step in range(1, MAX_STEPS + 1)}


def test_kill_mid_save_then_resume(tmp_path):
    prompts = write_jsonl(
        [{**row, "label": "mixed"} for row in make_rows(NUM_PROMPTS, seed=6)], tmp_path / "prompts.jsonl"
    )
    ckpt_dir, crashed = tmp_path / "ckpt", tmp_path / "crashed"
    tag = f"OPENPPO_CRASH_TEST={uuid.uuid4().hex}"
    env = {**cli_env(), tag.split("=")[0]: tag.split("=")[1]}
    cmd = [sys.executable, "-m", "openppo.cli.train_ppo_ray", *_args(prompts, crashed, ckpt_dir)]
    log = tmp_path / "crashed.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        saving = ckpt_dir / "actor" / ckpt.tag_for_step(KILL_AT)
        while not saving.exists():  # the save of step KILL_AT has begun: kill the driver now
            assert proc.poll() is None, f"the run ended before step {KILL_AT} was saved:\n{log.read_text()[-6000:]}"
            assert time.monotonic() < deadline, log.read_text()[-6000:]
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        kill_tree(proc, tag)
    assert proc.returncode == -signal.SIGKILL

    committed = ckpt.resolve(ckpt_dir)
    assert committed is not None and committed.step in (KILL_AT - 1, KILL_AT), committed
    k = committed.step
    # What a crash during the next save could leave, made by hand so it exists whatever the kill interrupted:
    # the actor's tag folder with a truncated file, DeepSpeed's `latest` naming it, a truncated marker.
    partial = ckpt_dir / "actor" / ckpt.tag_for_step(k + 1)
    partial.mkdir(parents=True, exist_ok=True)
    (partial / "mp_rank_00_model_states.pt").write_bytes(b"PK\x03\x04truncated")
    (ckpt_dir / "actor" / "latest").write_text(ckpt.tag_for_step(k + 1))
    ckpt.marker_path(ckpt_dir, k + 1).write_text(f'{{"global_step": {k + 1}, "tag": "global_st')
    assert ckpt.resolve(ckpt_dir).step == k

    before, logged = _rollouts(crashed), read_metrics(crashed)
    assert [r["step"] for r in logged] == list(range(1, KILL_AT + 1))
    proc2 = run_cli(
        "train_ppo_ray",
        _args(prompts, crashed, ckpt_dir) + ["--load_checkpoint", "--save_hf_ckpt"],
        nproc=1,
        timeout=600,
    )
    text = proc2.stdout + proc2.stderr
    assert f"resumed from {ckpt_dir} at step {k} (prompt {k * ROLLOUT_BATCH} of" in text, text[-4000:]
    assert f"global_step{k + 1}.json: unreadable" in text  # the truncated marker was seen and skipped
    # Each step once in the shared logs: rows the crashed run wrote after step k were moved aside, and said so.
    records = read_metrics(crashed)
    assert [r["step"] for r in records] == list(range(1, MAX_STEPS + 1))
    assert records[:k] == logged[:k]
    assert records[k]["rollout/logprob_diff"] < 1e-4  # the engine was re-synced to the checkpoint's weights
    for log, stem in (("metrics.jsonl", "metrics"), ("rollouts.jsonl", "rollouts")):
        aside = crashed / f"{stem}.after_step{k}.jsonl"
        moved = [json.loads(line)["step"] for line in aside.read_text().splitlines()] if aside.exists() else []
        assert moved == list(range(k + 1, KILL_AT + 1)), (log, moved)
        assert (f"the rows of {log} after it were moved to {aside.name}" in text) == bool(moved)

    # The prompts of every step: the killed run up to its last step, the resumed run after k, as one unbroken run.
    expected, after = _expected_prompts(), _rollouts(crashed)
    assert max(before) == KILL_AT  # killed while saving step KILL_AT, before step KILL_AT + 1 drew prompts
    assert list(after) == list(range(1, MAX_STEPS + 1))
    after = {step: row for step, row in after.items() if step > k}
    for step, row in before.items():
        assert row["taken"] == expected[step], (step, row, expected)
    for step, row in after.items():
        assert row["taken"] == expected[step], (step, row, expected)
        if step in before:
            assert row["taken"] == before[step]["taken"] and row["prompts"] == before[step]["prompts"]

    # The corrupt step k+1 was saved again over the leftovers; rotation kept the two newest commits, nothing else.
    assert [c.step for c in ckpt.list_commits(ckpt_dir)] == [MAX_STEPS - 1, MAX_STEPS]
    assert ckpt.list_tags(ckpt_dir / "actor") == [ckpt.tag_for_step(MAX_STEPS - 1), ckpt.tag_for_step(MAX_STEPS)]
    assert sorted(p.name for p in (ckpt_dir / "committed").iterdir()) == [
        f"{ckpt.tag_for_step(s)}.json" for s in (MAX_STEPS - 1, MAX_STEPS)
    ]
    assert (ckpt_dir / "actor" / "latest").read_text().strip() == ckpt.tag_for_step(MAX_STEPS)
    # --save_hf_ckpt: an HF folder beside each checkpoint, rotated with them; the last one is the final model
    kept = [ckpt.hf_export_dir(ckpt_dir, s).name for s in (MAX_STEPS - 1, MAX_STEPS)]
    assert sorted(p.name for p in ckpt_dir.glob("*_hf")) == kept
    last = load_file(ckpt_dir / f"{ckpt.tag_for_step(MAX_STEPS)}_hf" / "model.safetensors")
    final = load_file(crashed / "model.safetensors")
    assert last.keys() == final.keys() and all(torch.equal(last[name], final[name]) for name in final)
