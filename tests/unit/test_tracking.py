"""Metrics sinks: a NaN or Inf metric reaches every sink as such; a resume leaves each step once in a log."""

import json
import logging
import math

import pytest

from openppo.utils.tracking import MetricsTracker, set_aside_rows_after


def test_non_finite_metrics_are_written_not_dropped(tmp_path, caplog):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracker = MetricsTracker(
        save_dir=str(tmp_path),
        tensorboard_dir=str(tmp_path / "tb"),
        wandb=None,
        wandb_project="p",
        run_name="r",
        config={},
    )
    with caplog.at_level(logging.INFO, logger="openppo.utils.tracking"):
        tracker.log(1, {"loss": float("nan"), "grad": float("inf"), "neg": float("-inf"), "ok": 0.5})
        tracker.log(2, {"loss": float("nan"), "ok": 0.25})
    tracker.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert {k: rows[0][k] for k in ("loss", "grad", "neg", "ok")} == {
        "loss": "nan",
        "grad": "inf",
        "neg": "-inf",
        "ok": 0.5,
    }
    assert rows[1]["loss"] == "nan"
    # stdout shows them, and one warning names each non-finite metric once
    echoed = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step 1 |")]
    assert echoed and "loss=nan" in echoed[0] and "grad=inf" in echoed[0] and "neg=-inf" in echoed[0]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "loss=nan" in warnings[0] and "grad=inf" in warnings[0], warnings
    events = EventAccumulator(str(next((tmp_path / "tb").iterdir()))).Reload()
    assert math.isnan(events.Scalars("loss")[0].value) and math.isinf(events.Scalars("grad")[0].value)
    assert [e.step for e in events.Scalars("loss")] == [1, 2]


def test_a_resume_sets_aside_the_rows_after_its_step(tmp_path):
    path = tmp_path / "metrics.jsonl"
    writer = open(path, "a", buffering=1)  # the tracker of the resumed run already holds the log open
    for step in (1, 2, 3, 4):
        writer.write(json.dumps({"step": step, "x": step}) + "\n")
    aside = set_aside_rows_after(path, 2)
    assert aside == tmp_path / "metrics.after_step2.jsonl"
    assert [json.loads(line)["step"] for line in aside.read_text().splitlines()] == [3, 4]
    writer.write(json.dumps({"step": 3, "x": 30}) + "\n")  # the resumed run's step 3, after the kept rows
    writer.close()
    assert [json.loads(line) for line in path.read_text().splitlines()] == [
        {"step": 1, "x": 1},
        {"step": 2, "x": 2},
        {"step": 3, "x": 30},
    ]
    assert set_aside_rows_after(path, 3) is None  # nothing after step 3: untouched
    assert set_aside_rows_after(tmp_path / "absent.jsonl", 1) is None


def test_wandb_org_and_group_reach_the_run(tmp_path, monkeypatch):
    """--wandb_org / --wandb_group (OpenRLHF's --logger.wandb.org / .group) file the run under that entity and
    group; offline, so no network is needed."""
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracker = MetricsTracker(
        save_dir=str(tmp_path),
        tensorboard_dir=None,
        wandb="offline",
        wandb_project="p",
        run_name="r",
        config={},
        wandb_org="some-team",
        wandb_group="ablation-1",
    )
    run = tracker._wandb
    assert (run.entity, run.group, run.name) == ("some-team", "ablation-1", "r")
    tracker.close()


def test_a_wandb_key_wandb_does_not_take_is_one_line_naming_the_flag(tmp_path, monkeypatch):
    """OpenRLHF's recipe with a reward function passes `--logger.wandb.key {wandb_token}` (its placeholder): W&B's
    own UsageError came out as a traceback; it is one line naming --use_wandb (no network: no key is configured, so
    W&B refuses before it connects)."""
    from openppo.errors import UserError

    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("HOME", str(tmp_path))  # (no ~/.netrc)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    with pytest.raises(UserError, match=r"^--use_wandb: W&B did not start \(.*\); pass a valid API key"):
        MetricsTracker(
            save_dir=str(tmp_path),
            tensorboard_dir=None,
            wandb="{wandb_token}",
            wandb_project="p",
            run_name="r",
            config={},
        )


def test_compiler_command_lines_stay_out_of_stdout():
    """DeepSpeed's op builders probe the system by compiling a test program, and distutils logs each compiler command
    to the root logger at INFO: two lines on every rank's start, before this filter. Run in a process of its own
    (setup_logging reconfigures logging), with the real probe; openppo's named loggers, the root logger's own INFO
    lines (a user's reward function may log so) and root warnings still show."""
    import subprocess
    import sys

    code = """
import logging
from openppo.utils.tracking import setup_logging
setup_logging(0)
from deepspeed.ops.op_builder import AsyncIOBuilder
AsyncIOBuilder().is_compatible()
logging.info("a user's line")
logging.getLogger("openppo.probe").info("a line of ours")
logging.warning("a root warning")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    lines = out.splitlines()
    assert any(line.endswith("I openppo.probe: a line of ours") for line in lines), out
    assert any(line.endswith("W root: a root warning") for line in lines), out
    assert any(line.endswith("I root: a user's line") for line in lines), out
    assert not any("-laio" in line or "test.c" in line for line in lines), out
