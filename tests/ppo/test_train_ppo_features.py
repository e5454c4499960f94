"""train_ppo_ray end to end: hybrid engine (everything colocated, sleep flags) with the actor split by AutoTP
(--ds_tensor_parallel_size 2) and delta weight syncs (--vllm_sync_delta), DAPO dynamic filtering, eval with pass@k,
checkpoints, and a resume that sees the same prompts as the unbroken run. --enable_ema with --ema_beta 1 keeps the
initial weights as the average: every export (best, final, resumed final) must hold them exactly
(tests/ppo/test_ema.py checks the average of moving weights). Real Ray + DeepSpeed + vLLM CPU, tiny model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from openppo.tasks.arithmetic import make_rows, write_jsonl
from tests.cli.helpers import read_metrics, run_cli, series
from tests.model_cache import tiny_model_dir

pytestmark = pytest.mark.slow
HERE = Path(__file__).parent


def _rows(n: int, seed: int) -> list[dict]:
    rows = make_rows(n, seed=seed)
    for i, row in enumerate(rows):
        row["label"] = ("mixed", "always", "never")[i % 3]
    return rows


def _rollouts(save: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (save / "rollouts.jsonl").read_text().splitlines())}


def _max_gap(a: Path, b: Path) -> float:
    """Largest difference between two HF folders' weights."""
    from safetensors.torch import load_file

    x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert set(x) == set(y)
    return max((x[k].float() - y[k].float()).abs().max().item() for k in x)


def test_hybrid_engine_filtering_eval_checkpoint_and_resume(tmp_path):
    rows = _rows(36, seed=4)
    prompts = write_jsonl(rows, tmp_path / "prompts.jsonl")
    evals = write_jsonl(_rows(3, seed=5), tmp_path / "eval.jsonl")
    save = tmp_path / "out"
    args = [
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
        "4",
        "--rollout_batch_size",
        "2",
        "--train_batch_size",
        "4",
        "--micro_train_batch_size",
        "2",
        "--micro_rollout_batch_size",
        "4",
        "--actor_num_gpus_per_node",
        "2",
        "--ref_num_gpus_per_node",
        "2",
        "--vllm_num_engines",
        "2",
        "--colocate_all_models",
        "--vllm_enable_sleep",
        "--deepspeed_enable_sleep",
        "--zero_stage",
        "2",
        "--init_kl_coef",
        "0.01",
        "--use_kl_loss",
        "--kl_estimator",
        "k3",
        "--dynamic_filtering",
        "--eval_dataset",
        str(evals),
        "--eval_steps",
        "2",
        "--eval_n_samples_per_prompt",
        "2",
        "--eval.eval_at_start",
        "--eval.max_new_tokens",
        "4",
        "--eval.top_p",
        "0.95",
        "--eval.batch_size",
        "1",
        "--best_metric_key",
        "eval/pass@1",
        "--vllm_kv_cache_bytes",
        str(128 * 2**20),
        "--generate_max_len",
        "12",
        "--prompt_max_len",
        "64",
        "--param_dtype",
        "fp32",
        "--max_steps",
        "3",
        "--save_steps",
        "2",
        "--actor_learning_rate",
        "1e-4",
        "--seed",
        "7",
        "--ds_tensor_parallel_size",
        "2",
        "--enable_ema",
        "--ema_beta",
        "1",
    ]
    delta = ["--vllm_sync_check", "--vllm_sync_delta"]
    proc = run_cli("train_ppo_ray", args + ["--save_path", str(save), *delta], nproc=1, timeout=800)
    log = proc.stdout + proc.stderr
    # both engines hold the AutoTP-gathered weights, tensor by tensor, after the first update and after the first
    # delta sync (each actor rank computes the changes for the engine worker on its device)
    assert log.count("--vllm_sync_check: 2 engine(s) compute with the trainer's weights") == 2
    assert "colocated (hybrid): actor, reference, engines share 2 device(s)" in log
    assert "--vllm_enable_sleep is a no-op on CPU" in log
    # engine i sits on actor rank i's bundle: each rank hands it the buckets through shared memory, no gloo group
    assert "weight sync: engine(s) 0,1 via shared memory from actor rank(s) 0,1" in log
    assert "weight sync group ready" not in log

    records = read_metrics(save)
    # --eval.eval_at_start: the untrained model's eval, logged at step 0 before the first rollout
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    start, records = records[0], records[1:]
    assert not any(k.startswith(("train/", "rollout/")) for k in start), start
    assert 0.0 <= start["eval/pass@1"] <= start["eval/pass@2"] <= 1.0
    # the eval's own budget (Molt's --eval.max_new_tokens 4) against the rollout's --generate_max_len 12
    assert all(r["eval/response_length"] <= 4 for r in [start] + records if "eval/response_length" in r)
    changed = series(records, "perf/weight_sync_changed")
    assert changed[0] == (1, 1.0) and all(0 < c <= 1 for _, c in changed[1:]), changed
    for r in records:
        assert r["timing/swap"] > 0  # ZeRO-2 states offloaded and reloaded around every generation
        assert r["rollout/logprob_diff"] < 1e-4
        assert 0.25 <= r["train/reward"] <= 0.75
        # --ds_tensor_parallel_size 2: each actor rank holds part of the weights (the embeddings stay whole)
        assert 0.5 < r["perf/actor_weight_share"] < 1.0
    labels = {i: row["label"] for i, row in enumerate(rows)}
    steps = _rollouts(save)
    for step, r in zip(steps.values(), records):
        # Every drawn "mixed" prompt is trained on, every "always"/"never" one dropped and replaced.
        assert step["prompts"] == [i for i in step["taken"] if labels[i] == "mixed"], step
        assert r["rollout/filtered_ratio"] == pytest.approx(1 - 2 / len(step["taken"]))
    assert sum(len(s["taken"]) for s in steps.values()) > 6  # at least one refill round happened
    # eval at step 2 only (eval_steps 2), pass@k over 2 samples of each eval prompt
    evaluated = [r for r in records if "eval/pass@1" in r]
    assert [r["step"] for r in evaluated] == [2]
    assert 0.0 <= evaluated[0]["eval/pass@1"] <= evaluated[0]["eval/pass@2"] <= 1.0
    # --best_metric_key: the one eval so far is the best: the actor of step 2 is exported, with its value
    best = save / "checkpoints" / "best"
    assert json.loads((best / "best.json").read_text()) == {
        "metric": "eval/pass@1",
        "value": evaluated[0]["eval/pass@1"],
        "step": 2,
    }
    assert (best / "config.json").is_file()
    ckpts = save / "checkpoints" / "actor"
    # --enable_ema --ema_beta 1: the average stays the initial weights, and every export holds it, not the actor
    initial = tiny_model_dir()
    assert _max_gap(best, initial) == 0.0 and _max_gap(save, initial) == 0.0
    assert (ckpts / "global_step2" / "ema.pt").is_file()
    assert (ckpts / "global_step2").is_dir() and (ckpts / "latest").read_text().strip() == "global_step3"
    assert sorted(p.name for p in (save / "checkpoints" / "committed").iterdir()) == [
        "global_step2.json",
        "global_step3.json",
    ]

    # Resume from step 2 as if the run had stopped there: step 3 draws the same prompts as the unbroken run.
    resumed = tmp_path / "resumed"
    shutil.copytree(ckpts / "global_step2", tmp_path / "ckpt" / "actor" / "global_step2")
    shutil.copytree(save / "checkpoints" / "committed", tmp_path / "ckpt" / "committed")  # markers of steps 2, 3
    (tmp_path / "ckpt" / "committed" / "global_step3.json").unlink()
    proc = run_cli(
        "train_ppo_ray",
        args + ["--save_path", str(resumed), "--ckpt_path", str(tmp_path / "ckpt"), "--load_checkpoint"],
        nproc=1,
        timeout=800,
    )
    assert "resumed from" in proc.stdout + proc.stderr
    again = _rollouts(resumed)
    assert list(again) == [3], series(read_metrics(resumed), "train/reward")
    assert again[3]["taken"] == steps[3]["taken"] and again[3]["prompts"] == steps[3]["prompts"]
    assert read_metrics(resumed)[0]["rollout/logprob_diff"] < 1e-4  # engines re-synced to the checkpoint
    assert [r["step"] for r in read_metrics(resumed)] == [3]  # a resumed run does not evaluate at start
    # the average came back from the checkpoint: restarted from the resumed (trained) weights it would differ
    assert _max_gap(resumed, initial) == 0.0
