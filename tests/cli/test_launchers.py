"""The supervised CLIs under every launcher and ZeRO stage not covered elsewhere (1 process, deepspeed)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from openppo.strategy.distributed import free_port
from tests.cli.data import sft_rows
from tests.cli.helpers import REPO, cli_env, read_metrics, run_cli, series, write_jsonl
from tests.model_cache import tiny_model_dir

pytestmark = pytest.mark.slow


def _args(tmp_path, stage: str):
    data = write_jsonl(tmp_path / "sft.jsonl", sft_rows(8))
    return [
        "--pretrain",
        str(tiny_model_dir()),
        "--dataset",
        str(data),
        "--apply_chat_template",
        "--max_len",
        "48",
        "--train_batch_size",
        "4",
        "--micro_train_batch_size",
        "2",
        "--max_steps",
        "2",
        "--zero_stage",
        stage,
        "--save_path",
        str(tmp_path / "out"),
    ]  # --param_dtype auto: bf16 on a CPU with bf16, else fp32


def test_single_process_zero0(tmp_path):
    run_cli("train_sft", _args(tmp_path, "0"), nproc=1)
    assert len(series(read_metrics(tmp_path / "out"), "train/loss")) == 2
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_deepspeed_launcher_zero1(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--num_gpus",
        "2",
        "--master_port",
        str(free_port()),  # (a fixed one meets whatever else on the box holds it)
        "--module",
        "openppo.cli.train_sft",
        *_args(tmp_path, "1"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=cli_env(), cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert len(series(read_metrics(tmp_path / "out"), "train/loss")) == 2
    # each rank resolves --param_dtype auto itself (no process group yet); ranks that disagreed would fail the
    # gradient all-reduce. Rank 0 logs the choice, and the logged config holds the concrete dtype.
    from openppo.utils.hardware import auto_param_dtype

    chosen = [line for line in (proc.stdout + proc.stderr).splitlines() if "--param_dtype auto ->" in line]
    assert len(chosen) == 1 and all(f"-> {auto_param_dtype()} on " in line for line in chosen), chosen
    info = json.loads((tmp_path / "out" / "run_info.json").read_text())
    assert info["config"]["ds"]["param_dtype"] == auto_param_dtype()


def test_a_preloaded_run_prints_and_exits_as_python_m_does(tmp_path):
    """The suite's single-process CLI runs fork from a preloaded Python (tests/cli/preloaded.py): the same output
    and status as `python -m` for help, a bad flag and a bad file; a run past its timeout is killed, the next runs."""
    from tests.cli import preloaded

    env = {k: v for k, v in cli_env().items() if k != "DS_ACCELERATOR"}
    server = preloaded.server_for(env, str(REPO))
    # importing openppo.strategy.distributed in this process sets DS_ACCELERATOR, as a run's imports do: same server
    assert server is not None and server.serves({**env, "DS_ACCELERATOR": "cpu"})
    changed = {**env, "OPENPPO_TEST_VARIABLE": "1"}  # any other change: a server of that environment
    assert not server.serves(changed) and preloaded.server_for(changed, str(REPO)).serves(changed)
    env = cli_env()
    server = preloaded.server_for(env, str(REPO))
    missing = ["--pretrain", str(tmp_path / "nothing"), "--dataset", "x", "--save_path", str(tmp_path / "out")]
    for argv in (["--help"], ["--no_such_flag"], missing):
        forked = server.run("openppo.cli.train_sft", argv, env, str(REPO), 300)
        fresh = subprocess.run(
            [sys.executable, "-m", "openppo.cli.train_sft", *argv], capture_output=True, text=True, env=env, cwd=REPO
        )
        assert (forked.returncode, forked.stderr) == (fresh.returncode, fresh.stderr), (forked, fresh)
        # (stdout: the log lines carry their time, and the bf16 probe its measured ratio)
        assert re.sub(r"[\d.]+", "#", forked.stdout) == re.sub(r"[\d.]+", "#", fresh.stdout), (forked, fresh)
    with pytest.raises(subprocess.TimeoutExpired):
        server.run("openppo.cli.train_sft", _args(tmp_path, "0"), env, str(REPO), 1)
    assert server.run("openppo.cli.train_sft", ["--help"], env, str(REPO), 300).returncode == 0


def test_preloaded_ranks_meet_with_the_environment_torchrun_gives(tmp_path):
    """A multi-rank run of the suite forks its ranks from the preloaded server (tests/cli/preloaded.py): each gets
    the variables torchrun's own ranks get, and they meet on `env://` as torchrun's do (on the agent's store)."""
    from tests.cli import preloaded

    env = cli_env()
    server = preloaded.server_for(env, str(REPO))
    (tmp_path / "forked").mkdir()
    (tmp_path / "fresh").mkdir()
    forked = server.run("tests.cli.launch_env", [str(tmp_path / "forked")], env, str(REPO), 300, nproc=2)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    launch = [*torchrun, "-m", "tests.cli.launch_env", str(tmp_path / "fresh")]
    fresh = subprocess.run(launch, capture_output=True, text=True, env=env, cwd=REPO)
    assert forked.returncode == fresh.returncode == 0, (forked, fresh)

    def ranks(folder: str) -> dict[str, dict]:
        lines = [json.loads((tmp_path / folder / f"rank{rank}.json").read_text()) for rank in (0, 1)]
        assert [line["sum"] for line in lines] == [1, 1], folder  # 0 + 1: both ranks met
        # the values a launch picks anew: its port, run id and error files; what the server's imports set (the
        # fresh ranks' imports set it too, later)
        masked = {"MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_ERROR_FILE", *server.added}
        return {line["env"]["RANK"]: {k: v for k, v in line["env"].items() if k not in masked} for line in lines}

    assert ranks("forked") == ranks("fresh")
