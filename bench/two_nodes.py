"""Benchmark: the same GRPO steps on one Ray node and on two, in one invocation.

    .venv/bin/python bench/two_nodes.py              # tiny model, 5 steps each (needs root: network namespaces)
    .venv/bin/python bench/two_nodes.py --steps 8

Runs `openppo.cli.train_ppo_ray` twice with the same prompts, seed and flags (2 actor ranks, ZeRO-3, 2 vLLM engines,
GRPO, 1 thread per process):
- `one_node`: the run's own one-node cluster of this machine (the default placement, PACK);
- `two_nodes`: a cluster of two Ray nodes on this machine, each in a network namespace of its own with its own IP
  address, joined by a veth pair (`tests/two_nodes.py`, as the CI test), with --placement_strategy STRICT_SPREAD:
  one actor rank on each node, so ZeRO-3's collectives and the weight broadcast cross the link.
Both share this machine's cores, so the ratio is the cost of the two-node path itself (the network stack between
the nodes, placement), not of slower hardware. The step time is `timing/step` from metrics.jsonl averaged over
steps 2..N (step 1 includes start-up effects). The last line printed is one JSON object with the per-run numbers,
the ratios and the device it ran on (`bench/record.py`).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.record import emit, run_train_ppo  # noqa: E402 (after the path set-up)

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5)
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
    ratios = {f"{stage}_two_over_one": round(two[f"{stage}_s"] / one[f"{stage}_s"], 3) for stage in STAGES}
    emit({"bench": "two_nodes", "steps": args.steps, "one_node": one, "two_nodes": two, **ratios})


if __name__ == "__main__":
    main()
