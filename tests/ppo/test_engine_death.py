"""A vLLM engine that dies mid-generation is replaced and the run goes on; past --max_engine_restarts the run stops
within 2 minutes with an error that names the engine, its process and its last log lines, and leaves the committed
checkpoint intact. Real Ray + DeepSpeed + vLLM CPU, tiny model; the faults are SIGKILLs of the engine's actor
process or of vLLM's engine core under it, sent while the engine generates (tests/engine_kills.py)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
import torch

from openppo.strategy import checkpoint as ckpt
from openppo.tasks.arithmetic import make_rows, write_jsonl
from tests.cli.helpers import BackgroundRun, read_metrics
from tests.engine_kills import engine_pid, engine_pids, kill_while_generating
from tests.model_cache import tiny_model_dir

pytestmark = pytest.mark.slow
HERE = Path(__file__).parent
STOP_WITHIN_S = 120
WAIT_S = 600


def _args(prompts: Path, save: Path, *extra: str, new_tokens: int = 48) -> list[str]:
    return [
        "--pretrain",
        str(tiny_model_dir()),
        "--remote_rm_url",
        str(HERE / "label_reward.py"),
        "--prompt_data",
        str(prompts),
        "--save_path",
        str(save),
        # `new_tokens` per sample (a random tiny model seldom stops early): generation is most of a step, so a kill
        # that waits for the engine to be busy lands mid-generation
        *(
            "--input_key input --label_key label --apply_chat_template --advantage_estimator group_norm "
            "--n_samples_per_prompt 2 --rollout_batch_size 2 --train_batch_size 4 --micro_train_batch_size 2 "
            f"--vllm_kv_cache_bytes {128 * 2**20} --init_kl_coef 0 --generate_max_len {new_tokens} --prompt_max_len 64 "
            "--param_dtype fp32 --zero_stage 0 --actor_learning_rate 1e-3"
        ).split(),
        *extra,
    ]


class _Run(BackgroundRun):
    """train_ppo_ray with one engine, on its own Ray cluster."""

    def __init__(self, tmp_path: Path, args: list[str]):
        super().__init__("train_ppo_ray", args, tmp_path / "driver.log", save=tmp_path / "out")

    def restarts(self) -> int:
        return self.text().count("vLLM engine 0: restarted in")

    def kill_engine(self, *, core: bool = False, busy_s: float = 0.06) -> int:
        return kill_while_generating(engine_pid(self.text()), core=core, busy_s=busy_s)


def _trained_batches(save: Path) -> list[tuple[int, int]]:
    """(step, prompts trained) of every line of rollouts.jsonl."""
    rows = [json.loads(line) for line in (save / "rollouts.jsonl").read_text().splitlines()]
    return [(row["step"], len(row["prompts"])) for row in rows]


def test_a_dead_engine_is_replaced_until_the_bound_then_the_run_stops(tmp_path):
    """The hybrid engine (--colocate_all_models: the engine on the actor rank's device, weights by shared memory),
    synchronous steps, --max_engine_restarts 1. Kill 1, vLLM's engine core under the engine (an error inside vLLM:
    the engine notices and exits): a new engine starts on the same bundle, is synced to the current weights and
    generates the lost prompts, and the steps go on. Kill 2, the new engine's actor process: past the bound, the run
    stops naming the engine; the committed checkpoint loads. Every step trains one whole batch, once, on samples whose
    log-probs are the trainer's (fp32): the replacement generates with the current weights. (A killed actor process
    is replaced in the next test and in tests/ppo/test_two_nodes.py.)"""
    prompts = write_jsonl([{**row, "label": "mixed"} for row in make_rows(64, seed=3)], tmp_path / "prompts.jsonl")
    ckpt_dir = tmp_path / "ckpt"
    # 192 new tokens: a generation keeps the engine core busy 0.5 s (native AMD EPYC, idle), a weight sync 0.02-0.04
    # s, so a kill after 0.15 s of busy lands with 0.3 s of the generation left. With 48 tokens (0.12-0.15 s) and a
    # kill after 0.06 s, a loaded box once killed it as the generation ended: a weight sync noticed the death.
    args = _args(prompts, tmp_path / "out", "--colocate_all_models", "--max_engine_restarts", "1", new_tokens=192)
    run = _Run(tmp_path, args + ["--max_steps", "100", "--save_steps", "1", "--ckpt_path", str(ckpt_dir)])
    try:
        run.wait_for("step 1", lambda: run.steps() >= 1)
        first = engine_pid(run.text())
        core = run.kill_engine(core=True, busy_s=0.15)
        at = run.steps()
        run.wait_for("the restart and 2 more steps", lambda: run.restarts() == 1 and run.steps() >= at + 2)
        last = engine_pid(run.text())
        kill_while_generating(last, busy_s=0.15)
        killed_at = time.monotonic()
        try:
            code = run.proc.wait(timeout=STOP_WITHIN_S + 60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the run did not stop after its engine died past the bound:\n{run.text()[-6000:]}")
        stopped_after = time.monotonic() - killed_at
    finally:
        run.close()
    text = run.text()
    assert code == 1, text[-6000:]
    assert engine_pids(text) == [first, last], (engine_pids(text), first, last)
    warning = next(line for line in text.splitlines() if "(restart 1 of at most 1)" in line)
    assert f"vLLM engine 0 (pid {first} " in warning and "died (noticed by a generation" in warning, warning
    # the engine core's death, as the engine itself reported it before it exited
    assert f"vLLM's process VLLM::EngineCore (pid {core}) exited" in text, text[-6000:]
    assert text.count("vLLM engines re-synced to weight version") == 1, text[-6000:]
    assert "vLLM engine 0: the prompts it lost were generated again" in text, text[-6000:]
    assert stopped_after <= STOP_WITHIN_S, (stopped_after, text[-6000:])
    error = text[text.index("error: vLLM engine 0 (") :]
    headline = error.splitlines()[0]
    assert f"pid {last}" in headline and "died; the run was stopped (--max_engine_restarts 1: 1 restart(s)" in headline
    assert "--- last" in error and "lines of std" in error, error  # the engine's own last log lines
    assert "Traceback" not in error, error  # the diagnosis, not the driver's stack

    records = read_metrics(run.save)
    steps = [r["step"] for r in records]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 3, steps
    assert records[0]["rollout/engine_restarts"] == 0 and records[-1]["rollout/engine_restarts"] == 1, records
    assert all(r["rollout/logprob_diff"] < 1e-4 for r in records), [r["rollout/logprob_diff"] for r in records]
    assert _trained_batches(run.save)[: len(steps)] == [(s, 2) for s in steps]
    committed = ckpt.resolve(ckpt_dir)
    assert committed is not None and committed.step >= len(steps) - 1
    states = ckpt_dir / "actor" / ckpt.tag_for_step(committed.step) / "mp_rank_00_model_states.pt"
    assert "module" in torch.load(states, map_location="cpu", weights_only=False)  # loadable, not torn
    print(f"{len(steps)} steps, 1 restart; the second death stopped the run {stopped_after:.1f} s later")


def test_async_partial_rollout_outlives_a_dead_engine(tmp_path):
    """--async_train --partial_rollout with an engine of its own (weights by a gloo broadcast group): the engine
    is killed while it generates a batch ahead on the rollout thread. Its replacement joins a new broadcast group,
    is synced once the actor is between steps, and generates the lost prompts again; the run ends at --max_steps
    with each step once, a whole batch each, and no sample older than --async_queue_size 1 allows (a replacement
    that had missed the sync would tag its tokens with version 0)."""
    prompts = write_jsonl([{**row, "label": "mixed"} for row in make_rows(32, seed=4)], tmp_path / "prompts.jsonl")
    args = _args(prompts, tmp_path / "out", "--async_train", "--async_queue_size", "1", "--partial_rollout")
    run = _Run(tmp_path, args + ["--max_steps", "7", "--vllm_sync_backend", "gloo"])
    try:
        run.wait_for("step 2", lambda: run.steps() >= 2)
        killed = run.kill_engine()
        code = run.proc.wait(timeout=WAIT_S)
    finally:
        run.close()
    text = run.text()
    assert code == 0, text[-6000:]
    warning = next(line for line in text.splitlines() if "(restart 1 of at most 3)" in line)
    assert f"vLLM engine 0 (pid {killed} " in warning, warning
    # Killed while it generated ahead: the generation it was running is lost and generated again by the replacement.
    # Which thread hits the death first is a race the run must (and does) take either way: the rollout thread's
    # generation, the trainer's check before its weight sync, or that sync itself (--partial_rollout lets a sync land
    # mid-generation, and Ray may not yet count the killed actor dead when the check runs).
    noticed = ("died (noticed by a generation", "died (noticed before a weight sync", "died (noticed by a weight sync")
    assert any(path in warning for path in noticed), warning
    assert text.count("vLLM engine 0: the prompts it lost were generated again") == 1, text[-6000:]
    # a new broadcast group with the new engine (the driver's own lines: Ray folds an actor's repeated ones)
    assert text.count("weight sync: engine(s) 0 via gloo broadcast") == 2, text[-6000:]
    records = read_metrics(run.save)
    assert [r["step"] for r in records] == list(range(1, 8))
    assert records[0]["rollout/engine_restarts"] == 0 and records[-1]["rollout/engine_restarts"] == 1
    assert all(r["rollout/staleness_max"] <= 1 for r in records), [r["rollout/staleness_max"] for r in records]
    assert _trained_batches(run.save) == [(s, 2) for s in range(1, 8)]
