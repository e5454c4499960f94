"""Soak: a long GRPO run on the two-node cluster with vLLM engines killed every ~40 steps, against the same run
without faults, in one invocation.

    .venv/bin/python bench/soak.py                       # 300 steps, an engine killed every 40 (needs root)
    .venv/bin/python bench/soak.py --steps 80 --kill_every 20

Both runs use the tiny model on a cluster of two Ray nodes on this machine (`tests/two_nodes.py`: each node in a
network namespace of its own), GRPO with one actor rank per node (ZeRO-3, --placement_strategy STRICT_SPREAD), two
vLLM engines, the same prompts and seed. In the faulty run, each time the step count passes a multiple of
`--kill_every`, one engine's actor process (the two in turn) is killed with SIGKILL once it is busy
(`tests/engine_kills.py`), and the run replaces it (--max_engine_restarts). Shown:
- trained samples: per run, the batches in rollouts.jsonl and the samples in them; the prompts each step drew must
  be the same in both runs;
- memory and descriptors: every 2 s, the RSS and open file descriptors of the driver, the actor ranks, the engines and
  vLLM's engine cores; per process, the change from the first sample after warm-up (`--warmup` of the steps, or of
  the process's life for an engine started later) to its last sample before the last step (then the run shuts
  down), and the least-squares slope over those samples per 100 steps, over the whole window and over its second
  half, for windows of at least 100 steps (`MIN_SLOPE_STEPS`);
- leftovers: the processes of the run (actor ranks, engines, engine cores) still alive 30 s after it ended.
The last line printed is one JSON object with both runs' numbers and the device (`bench/record.py`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.record import emit  # noqa: E402 (after the path set-up)

ROLES = {"ray::ActorWorker": "actor", "ray::VLLMEngine": "engine", "VLLM::EngineCore": "engine_core"}
SAMPLE_S = 2.0


def _role(proc: psutil.Process) -> str | None:
    try:
        title = " ".join(proc.cmdline()) or proc.name()
    except psutil.Error:
        return None
    return next((role for prefix, role in ROLES.items() if title.startswith(prefix)), None)


def _cluster_processes(ips: tuple[str, str]) -> list[psutil.Process]:
    """The processes under the cluster's raylets (its Ray workers and their children)."""
    out = []
    for proc in psutil.process_iter(["name", "cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or ())
        if proc.info["name"] == "raylet" and any(f"node_ip_address={ip}" in cmd for ip in ips):
            try:
                out += proc.children(recursive=True)
            except psutil.Error:
                continue
    return out


class Sampler(threading.Thread):
    """Every SAMPLE_S: (seconds, step, pid, role, rss MiB, open fds) of the driver and the run's processes."""

    def __init__(self, driver: int, ips: tuple[str, str], metrics: Path):
        super().__init__(daemon=True)
        self.driver, self.ips, self.metrics = driver, ips, metrics
        self.rows: list[tuple] = []
        self.stop = threading.Event()
        self.start_time = time.monotonic()

    def step(self) -> int:
        return len(self.metrics.read_text().splitlines()) if self.metrics.is_file() else 0

    def run(self) -> None:
        while not self.stop.wait(SAMPLE_S):
            procs = [(psutil.Process(self.driver), "driver")]
            procs += [(p, role) for p in _cluster_processes(self.ips) if (role := _role(p))]
            step, now = self.step(), time.monotonic() - self.start_time
            for proc, role in procs:
                try:
                    self.rows.append((now, step, proc.pid, role, proc.memory_info().rss / 2**20, proc.num_fds()))
                except psutil.Error:
                    continue


def slope_per_100_steps(samples: list[tuple], column: int) -> float:
    """The least-squares slope of one column of `samples` against their step, per 100 steps: a leak grows with the
    steps, where the two ends alone also catch a passing peak (a batch being scored, a sync in flight)."""
    steps = [s[1] for s in samples]
    values = [s[column] for s in samples]
    mean_step, mean_value = sum(steps) / len(steps), sum(values) / len(values)
    spread = sum((x - mean_step) ** 2 for x in steps)
    if spread == 0:
        return 0.0
    return 100 * sum((x - mean_step) * (y - mean_value) for x, y in zip(steps, values)) / spread


MIN_SLOPE_STEPS = 100  # a slope over fewer steps mostly measures the process's own warm-up


def drift(rows: list[tuple], steps: int, warmup: float) -> dict:
    """Per process, RSS and descriptors at the first sample after warm-up and at its last sample, and the slope of
    each over the steps between (over the whole window and over its second half: a leak keeps its slope, a heap
    that settles loses it), for windows of at least MIN_SLOPE_STEPS steps; per role, the largest of each."""
    by_pid: dict[int, list[tuple]] = {}
    for row in rows:
        by_pid.setdefault(row[2], []).append(row)
    per_role: dict[str, dict] = {}
    for samples in by_pid.values():
        role, first_step, last_step = samples[0][3], samples[0][1], samples[-1][1]
        after = first_step + warmup * (last_step - first_step if first_step else steps)
        settled = [s for s in samples if after <= s[1] < steps]  # (after the last step the run shuts down)
        if len(settled) < 2:
            continue
        start, end = settled[0], settled[-1]
        entry = per_role.setdefault(role, {"processes": 0, "rss_change_mib_max": 0.0, "fds_change_max": 0})
        entry["processes"] += 1
        if end[1] - start[1] >= MIN_SLOPE_STEPS:
            middle = start[1] + (end[1] - start[1]) / 2
            late = [s for s in settled if s[1] >= middle]
            slopes = {
                "rss_mib_per_100_steps_max": slope_per_100_steps(settled, 4),
                "rss_mib_per_100_steps_late_max": slope_per_100_steps(late, 4),
                "fds_per_100_steps_max": slope_per_100_steps(settled, 5),
            }
            for key, value in slopes.items():
                entry[key] = round(max(value, entry.get(key, 0.0), key=abs), 2)
        rss_change, fds_change = end[4] - start[4], end[5] - start[5]
        if abs(rss_change) >= abs(entry["rss_change_mib_max"]):
            entry["rss_change_mib_max"] = round(rss_change, 1)
            entry["rss_mib_at"] = [round(start[4], 1), round(end[4], 1)]
            entry["steps"] = [start[1], end[1]]
        if abs(fds_change) >= abs(entry["fds_change_max"]):
            entry["fds_change_max"] = fds_change
            entry["fds_at"] = [start[5], end[5]]
    return per_role


def soak(name: str, flags: list[str], workdir: Path, nodes, steps: int, kill_every: int, warmup: float) -> dict:
    from tests.cli.helpers import BackgroundRun
    from tests.engine_kills import engine_pid, kill_while_generating

    save, log = workdir / name, workdir / f"{name}.log"
    began = time.monotonic()
    run = BackgroundRun(
        "train_ppo_ray",
        [*flags, "--save_path", str(save)],
        log,
        save=save,
        ray_address=nodes.address,
        env={"RAY_AUTH_MODE": "disabled"},
    )
    proc = run.proc
    sampler = Sampler(proc.pid, (nodes.head_ip, nodes.worker_ip), save / "metrics.jsonl")
    sampler.start()
    kills = []
    try:
        while proc.poll() is None:
            step = sampler.step()
            if kill_every and step >= kill_every * (len(kills) + 1) and step < steps:
                engine = len(kills) % 2
                kill_while_generating(engine_pid(log.read_text(), engine), busy_s=0.02)
                kills.append({"step": step, "engine": engine})
                print(f"{name}: killed engine {engine} after step {step}", flush=True)
            time.sleep(0.2)
    finally:
        sampler.stop.set()
        if proc.poll() is None:
            run.close()
    wall = time.monotonic() - began
    if proc.returncode != 0:
        raise SystemExit(f"{name}: train_ppo_ray exited {proc.returncode}:\n{log.read_text()[-4000:]}")
    deadline = time.monotonic() + 30
    while (left := [p.pid for p in _cluster_processes((nodes.head_ip, nodes.worker_ip)) if _role(p)]) and (
        time.monotonic() < deadline
    ):
        time.sleep(1)
    batches = [json.loads(line) for line in (save / "rollouts.jsonl").read_text().splitlines()]
    records = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines()]
    n = int(flags[flags.index("--n_samples_per_prompt") + 1])
    out = {
        "steps": len(records),
        "trained_samples": sum(len(b["prompts"]) * n for b in batches),
        "engine_restarts": records[-1]["rollout/engine_restarts"],
        "kills": kills,
        "step_s_median": round(sorted(r["timing/step"] for r in records)[len(records) // 2], 3),
        "wall_s": round(wall, 1),
        "drift": drift(sampler.rows, steps, warmup),
        "leftover_processes_after_30s": len(left),
    }
    print(f"{name}: {out}", flush=True)
    return {**out, "prompts": [b["prompts"] for b in batches]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--kill_every", type=int, default=40)
    parser.add_argument("--warmup", type=float, default=0.2, help="share of the steps (or a process's life) left out")
    args = parser.parse_args()

    from openppo.tasks.arithmetic import make_rows, write_jsonl
    from tests import two_nodes
    from tests.cli.helpers import cli_env
    from tests.model_cache import tiny_model_dir

    if two_nodes.why_not():
        raise SystemExit(f"bench/soak.py: {two_nodes.why_not()}")
    episodes = -(-args.steps // 50)
    with tempfile.TemporaryDirectory(prefix="bench_soak_") as tmp:
        workdir = Path(tmp)
        prompts = write_jsonl(make_rows(400, seed=1), workdir / "prompts.jsonl")
        flags = [
            *("--pretrain", str(tiny_model_dir()), "--prompt_data", str(prompts), "--max_steps", str(args.steps)),
            *("--remote_rm_url", str(REPO / "examples/reward_funcs/arithmetic.py"), "--num_episodes", str(episodes)),
            *(
                "--input_key input --label_key label --apply_chat_template --advantage_estimator group_norm "
                "--n_samples_per_prompt 4 --rollout_batch_size 8 --train_batch_size 32 --micro_train_batch_size 4 "
                "--micro_rollout_batch_size 8 --actor_num_gpus_per_node 2 --vllm_num_engines 2 --init_kl_coef 0 "
                "--generate_max_len 16 --prompt_max_len 64 --zero_stage 3 --param_dtype fp32 "
                "--actor_learning_rate 1e-5 --seed 7 --placement_strategy STRICT_SPREAD --save_steps 50 "
                f"--max_engine_restarts {args.steps // max(args.kill_every, 1) + 1}"
            ).split(),
        ]
        with two_nodes.two_nodes(cli_env(), head_cpus=4, worker_cpus=4) as nodes:
            clean = soak("fault_free", flags, workdir, nodes, args.steps, 0, args.warmup)
            faulty = soak("engine_kills", flags, workdir, nodes, args.steps, args.kill_every, args.warmup)
    same_prompts = clean.pop("prompts") == faulty.pop("prompts")
    emit(
        {
            "bench": "soak",
            "steps": args.steps,
            "kill_every": args.kill_every,
            "fault_free": clean,
            "engine_kills": faulty,
            "same_trained_samples": clean["trained_samples"] == faulty["trained_samples"],
            "same_prompts_per_step": same_prompts,
        }
    )


if __name__ == "__main__":
    main()
