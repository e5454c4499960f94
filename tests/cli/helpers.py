"""Running the real CLIs in subprocesses (torchrun, 2 ranks) and reading what they wrote."""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.cli import preloaded

REPO = Path(__file__).resolve().parents[2]
RAY_CLIS = {"train_ppo_ray"}


# torch.distributed's rendezvous variables: a test that set up a process group in the pytest process (world size 1)
# leaves them in its environment, with MASTER_PORT held by that process's store; a CLI run is a fresh launch.
RENDEZVOUS_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def cli_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in RENDEZVOUS_VARS}
    # One thread per rank: 2 ranks on 2 cores; more threads oversubscribe and run several times slower.
    env.update(
        {
            "OMP_NUM_THREADS": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONUNBUFFERED": "1",
            "WANDB_MODE": "offline",
            "HF_HUB_OFFLINE": "1",
        }
    )
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    return env


def run_cli(
    module: str,
    args: list[str],
    *,
    nproc: int = 2,
    timeout: int = 600,
    check: bool = True,
    ray_address: str | None = None,
) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node N -m openppo.cli.<module> args` (plain python for N = 1). A Ray CLI joins the
    cluster at `ray_address`, by default the session's (tests/ray_cluster.py)."""
    env = cli_env()
    if module in RAY_CLIS:
        from tests import ray_cluster

        env["RAY_ADDRESS"] = ray_address or ray_cluster.address()
    if nproc > 1:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            "-m",
            f"openppo.cli.{module}",
            *args,
        ]
    else:
        cmd = [sys.executable, "-m", f"openppo.cli.{module}", *args]
    server = preloaded.server_for(env, str(REPO))
    if server is not None:  # the same run, forked from a Python that imported its libraries once (preloaded.py)
        proc = server.run(f"openppo.cli.{module}", args, env, str(REPO), timeout, nproc)
    else:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{module} exited {proc.returncode}\nSTDOUT:\n{proc.stdout[-6000:]}\nSTDERR:\n{proc.stderr[-6000:]}"
        )
    return proc


class BackgroundRun:
    """`python -m openppo.cli.<module> args` in its own session, its output in `log`, every process it starts tagged
    (`tag`) for tests/processes.py's clean-up: the runs a test or a bench kills parts of while they go on.
    `ray_address`: a Ray CLI joins that cluster (its workers are then the cluster's, not tagged); by default it starts
    its own. `env`: variables over cli_env()'s."""

    def __init__(
        self,
        module: str,
        args: list[str],
        log: Path,
        *,
        save: Path,
        ray_address: str | None = None,
        env: dict[str, str] | None = None,
    ):
        import uuid

        self.log, self.save = Path(log), Path(save)
        self.tag = f"OPENPPO_BACKGROUND_RUN={uuid.uuid4().hex}"
        env = {**cli_env(), **(env or {}), "OPENPPO_BACKGROUND_RUN": self.tag.split("=")[1]}
        env.pop("RAY_ADDRESS", None)
        if ray_address:
            env["RAY_ADDRESS"] = ray_address
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", f"openppo.cli.{module}", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=REPO,
                start_new_session=True,
            )

    def text(self) -> str:
        return self.log.read_text()

    def steps(self) -> int:
        """Rows in metrics.jsonl: the steps logged so far."""
        path = self.save / "metrics.jsonl"
        return len(path.read_text().splitlines()) if path.is_file() else 0

    def wait_for(self, what: str, done, timeout_s: float = 600) -> None:
        """Poll until `done()`; the run must keep going meanwhile."""
        import time

        deadline = time.monotonic() + timeout_s
        while not done():
            assert self.proc.poll() is None, f"the run ended while waiting for {what}:\n{self.text()[-6000:]}"
            assert time.monotonic() < deadline, f"no {what} within {timeout_s} s:\n{self.text()[-6000:]}"
            time.sleep(0.05)

    def close(self) -> None:
        from tests.processes import kill_tree

        kill_tree(self.proc, self.tag)


_NON_FINITE = {"nan", "inf", "-inf"}


def read_metrics(save_path: Path) -> list[dict]:
    """metrics.jsonl rows, with the tracker's "nan"/"inf"/"-inf" strings read back as floats. Every metric in them
    must be listed in docs/metrics.md: each test that reads a run's metrics checks the docs against that run."""
    lines = (Path(save_path) / "metrics.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines if line.strip()]
    missing = undocumented_metrics({k for row in rows for k in row} - {"step", "time"})
    assert not missing, f"metrics logged but not listed in docs/metrics.md: {missing}"
    return [{k: float(v) if isinstance(v, str) and v in _NON_FINITE else v for k, v in row.items()} for row in rows]


@functools.cache
def documented_metrics() -> re.Pattern:
    """The names in the first column of docs/metrics.md's tables, as one pattern (`<...>` matches any text)."""
    names = []
    for line in (REPO / "docs" / "metrics.md").read_text().splitlines():
        cells = line.split("|")
        if len(cells) > 2:
            names += re.findall(r"`([a-z_]+/[^`]+)`", cells[1])
    parts = [re.escape(name).replace(r"\<", "<").replace(r"\>", ">") for name in names]
    return re.compile("|".join(re.sub(r"<[^>]+>", r".+", part) for part in parts))


def undocumented_metrics(names) -> list[str]:
    return sorted(name for name in names if not documented_metrics().fullmatch(name))


def series(records: list[dict], key: str) -> list[tuple[int, float]]:
    return [(r["step"], r[key]) for r in records if key in r]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def checkpoint_copy(save_path: Path, step: int, dest: Path) -> Path:
    """A checkpoint folder holding only `global_step<step>` of a finished run (its tag folder and commit marker), as
    if it had stopped there."""
    import shutil

    tag = f"global_step{step}"
    shutil.copytree(Path(save_path) / "checkpoints" / tag, dest / tag)
    (dest / "committed").mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(save_path) / "checkpoints" / "committed" / f"{tag}.json", dest / "committed")
    (dest / "latest").write_text(tag)
    return dest


def assert_resumed_like_unbroken(full_run: Path, resumed_run: Path, key: str, first_step: int, last_step: int):
    full = dict(series(read_metrics(full_run), key))
    again = dict(series(read_metrics(resumed_run), key))
    assert min(again) == first_step and max(again) == last_step, sorted(again)
    for step in range(first_step, last_step + 1):
        assert abs(again[step] - full[step]) <= 1e-4 * max(1.0, abs(full[step])), (step, again[step], full[step])
