"""Benchmark: the same GRPO steps on one Ray node and on two, and how long a replaced vLLM engine takes to
generate again, in one invocation.

    .venv/bin/python bench/two_nodes.py              # tiny model, 5 steps each (needs root: network namespaces)
    .venv/bin/python bench/two_nodes.py --steps 8
    .venv/bin/python bench/two_nodes.py --restart_model tiny    # the restart part on the tiny model (default: the
                                                                # demo's SmolLM2-135M and flags, examples/scripts)

Runs `openppo.cli.train_ppo_ray` twice with the same prompts, seed and flags (2 actor ranks, ZeRO-3, 2 vLLM engines,
GRPO, 1 thread per process):
- `one_node`: the run's own one-node cluster of this machine (the default placement, PACK);
- `two_nodes`: a cluster of two Ray nodes on this machine, each in a network namespace of its own with its own IP
  address, joined by a veth pair (`tests/two_nodes.py`, as the CI test), with --placement_strategy STRICT_SPREAD:
  one actor rank on each node, so ZeRO-3's collectives and the weight broadcast cross the link.
Both share this machine's cores, so the ratio is the cost of the two-node path itself (the network stack between
the nodes, placement), not of slower hardware. The step time is `timing/step` from metrics.jsonl averaged over
steps 2..N (step 1 includes start-up effects).

`engine_restart`: the demo's run (`make demo`: SmolLM2-135M, GRPO, one engine, CPU) for 3 steps on one node; once
step 1 is done its engine's actor process is killed with SIGKILL while it generates (`tests/engine_kills.py`), and
the driver's log, read every 20 ms, gives the seconds from the kill to: the death noticed (the pool's warning), the
new engine ready, every engine synced to the current weights (able to sample its first token with them: a prefill
later), and the dead engine's prompts generated again. The last line printed is one JSON object with the per-run
numbers, the ratios and the device it ran on (`bench/record.py`).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.record import emit, model_path, run_train_ppo  # noqa: E402 (after the path set-up)

STAGES = ("step", "generate", "reward", "actor_train", "weight_sync")


def run(name: str, flags: list[str], workdir: Path, ray_address: str | None) -> dict:
    from tests.cli.helpers import cli_env

    save = workdir / name
    env = {k: v for k, v in cli_env().items() if k != "RAY_ADDRESS"}
    env["RAY_AUTH_MODE"] = "disabled"
    if ray_address:
        env["RAY_ADDRESS"] = ray_address
    stdout, records, wall = run_train_ppo(name, flags, save, env)
    later = records[1:]
    out = {f"{stage}_s": round(sum(r[f"timing/{stage}"] for r in later) / len(later), 3) for stage in STAGES}
    out["process_wall_s"] = round(wall, 1)
    placed = [line.split("placement ", 1)[1] for line in stdout.splitlines() if "placement (" in line]
    out["placement"] = placed[0] if placed else None
    print(f"{name}: {out}", flush=True)
    return out


# driver log lines of a restart, in order (openppo/rollout/pool.py, openppo/ppo/trainer.py)
RESTART_EVENTS = {
    "noticed": "died (noticed by a generation",
    "ready": "vLLM engine 0: restarted in",
    "synced": "vLLM engines re-synced to weight version",
    "regenerated": "vLLM engine 0: the prompts it lost were generated again",
}


def engine_restart(model: str, workdir: Path) -> dict:
    """Seconds from a SIGKILL of the engine's actor process, mid-generation after step 1, to each of RESTART_EVENTS
    (module docstring), and the run's step time without the restart (the median `timing/step`)."""
    import json
    import statistics

    from openppo.tasks.arithmetic import make_rows, write_jsonl
    from tests.cli.helpers import BackgroundRun
    from tests.engine_kills import engine_pid, kill_while_generating

    save = workdir / "engine_restart"
    prompts = write_jsonl(make_rows(64, seed=0), workdir / "restart_prompts.jsonl")
    demo = (
        "--n_samples_per_prompt 8 --rollout_batch_size 8 --train_batch_size 64 --micro_train_batch_size 8 "
        "--micro_rollout_batch_size 16 --prompt_max_len 128 --generate_max_len 32 --zero_stage 2 "
        "--actor_learning_rate 2e-5 --lr_warmup_ratio 0 --lr_scheduler constant --packing_samples "
        f"--enable_prefix_caching --vllm_kv_cache_bytes {2**30}"
    )
    tiny = (
        "--n_samples_per_prompt 2 --rollout_batch_size 2 --train_batch_size 4 --micro_train_batch_size 2 "
        f"--prompt_max_len 64 --generate_max_len 48 --zero_stage 0 --param_dtype fp32 --vllm_kv_cache_bytes {2**27}"
    )
    flags = [
        *("--pretrain", model_path(model), "--prompt_data", str(prompts), "--save_path", str(save)),
        *("--remote_rm_url", str(REPO / "examples/reward_funcs/arithmetic.py"), "--max_steps", "3"),
        *"--input_key input --label_key label --apply_chat_template --advantage_estimator group_norm".split(),
        *"--init_kl_coef 0 --vllm_num_engines 1 --actor_num_gpus_per_node 1".split(),
        *(demo if model == "smollm2" else tiny).split(),
    ]
    log = workdir / "engine_restart.log"
    run = BackgroundRun("train_ppo_ray", flags, log, save=save, env={"RAY_AUTH_MODE": "disabled"})
    proc, metrics = run.proc, save / "metrics.jsonl"
    try:
        while not run.steps():
            if proc.poll() is not None:
                raise SystemExit(f"engine_restart: the run ended before step 1:\n{log.read_text()[-4000:]}")
            time.sleep(0.1)
        kill_while_generating(engine_pid(log.read_text()))
        killed = time.monotonic()
        seen: dict[str, float] = {}
        while len(seen) < len(RESTART_EVENTS) and proc.poll() is None:
            text = log.read_text()
            for event, line in RESTART_EVENTS.items():
                if event not in seen and line in text:
                    seen[event] = round(time.monotonic() - killed, 2)
            time.sleep(0.02)
        code = proc.wait(timeout=3600)
    finally:
        if proc.poll() is None:
            run.close()
    if code != 0 or len(seen) < len(RESTART_EVENTS):
        raise SystemExit(f"engine_restart: exit {code}, events seen {seen}:\n{log.read_text()[-4000:]}")
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    out = {
        "model": model,
        **{f"kill_to_{event}_s": seen[event] for event in RESTART_EVENTS},
        "step_s_median": round(statistics.median(r["timing/step"] for r in records), 2),
        "engine_restarts": records[-1]["rollout/engine_restarts"],
    }
    print(f"engine_restart: {out}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--restart_model", choices=("smollm2", "tiny"), default="smollm2")
    args = parser.parse_args()

    from openppo.tasks.arithmetic import make_rows, write_jsonl
    from tests import two_nodes
    from tests.cli.helpers import cli_env
    from tests.model_cache import tiny_model_dir

    if two_nodes.why_not():
        raise SystemExit(f"bench/two_nodes.py: {two_nodes.why_not()}")
    with tempfile.TemporaryDirectory(prefix="bench_two_nodes_") as tmp:
        workdir = Path(tmp)
        prompts = write_jsonl(make_rows(8 * args.steps, seed=1), workdir / "prompts.jsonl")
        flags = [
            "--pretrain",
            str(tiny_model_dir()),
            "--remote_rm_url",
            str(REPO / "examples/reward_funcs/arithmetic.py"),
            "--prompt_data",
            str(prompts),
            "--max_steps",
            str(args.steps),
            *(
                "--input_key input --label_key label --apply_chat_template --advantage_estimator group_norm "
                "--n_samples_per_prompt 4 --rollout_batch_size 8 --train_batch_size 16 --micro_train_batch_size 2 "
                "--micro_rollout_batch_size 4 --actor_num_gpus_per_node 2 --vllm_num_engines 2 --init_kl_coef 0 "
                "--generate_max_len 16 --prompt_max_len 64 --zero_stage 3 --param_dtype fp32 "
                "--actor_learning_rate 1e-4 --seed 7"
            ).split(),
        ]
        one = run("one_node", flags, workdir, None)
        with two_nodes.two_nodes(cli_env(), head_cpus=4, worker_cpus=4) as nodes:
            two = run("two_nodes", [*flags, "--placement_strategy", "STRICT_SPREAD"], workdir, nodes.address)
        restart = engine_restart(args.restart_model, workdir)
    ratios = {f"{stage}_two_over_one": round(two[f"{stage}_s"] / one[f"{stage}_s"], 3) for stage in STAGES}
    emit(
        {
            "bench": "two_nodes",
            "steps": args.steps,
            "one_node": one,
            "two_nodes": two,
            **ratios,
            "engine_restart": restart,
        }
    )


if __name__ == "__main__":
    main()
