"""Reward-server fixtures: real `serve_rm` subprocesses on 127.0.0.1 (port 0, read back from the ready line)."""

from __future__ import annotations

import queue
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.cli.helpers import cli_env

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "reward_funcs"
READY = re.compile(r"serving rewards on (http://\S+/get_reward)")


@dataclass
class Server:
    proc: subprocess.Popen
    url: str = ""
    startup_s: float = 0.0
    lines: list[str] = field(default_factory=list)
    started: float = 0.0
    line_queue: queue.Queue | None = None

    @property
    def base(self) -> str:
        return self.url.rsplit("/", 1)[0]

    def log(self) -> str:
        return "".join(self.lines[-60:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def launch(args: list[str]) -> Server:
    cmd = [sys.executable, "-m", "openppo.cli.serve_rm", "--port", "0", *args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=cli_env())
    server = Server(proc, started=time.monotonic(), line_queue=queue.Queue())
    lines = server.line_queue

    def pump():  # keeps draining the pipe so a chatty server never blocks on a full pipe
        for line in proc.stdout:
            server.lines.append(line)
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return server


def wait_ready(server: Server, timeout: float = 120.0) -> Server:
    deadline = server.started + timeout
    while True:
        try:
            line = server.line_queue.get(timeout=max(deadline - time.monotonic(), 0.01))
        except queue.Empty:
            server.stop()
            raise AssertionError(f"serve_rm not ready after {timeout} s:\n{server.log()}") from None
        if line is None:
            raise AssertionError(f"serve_rm exited with {server.proc.wait()} before it was ready:\n{server.log()}")
        match = READY.search(line)
        if match:
            server.url = match.group(1)
            server.startup_s = time.monotonic() - server.started
            return server


def start_servers(request, *arg_lists: list[str], timeout: float = 120.0) -> list[Server]:
    """Start every server at once (they load in parallel), stopped when the requesting scope ends."""
    servers = [launch(args) for args in arg_lists]
    for server in servers:
        request.addfinalizer(server.stop)
    return [wait_ready(server, timeout) for server in servers]


@pytest.fixture(scope="session")
def rm_dir(tmp_path_factory) -> Path:
    """A reward-model folder with a saved (random) score head and normalisation statistics."""
    import torch

    from openppo.models.hf import load_tokenizer, save_hf_folder
    from openppo.models.scalar import ScalarModel
    from tests.model_cache import tiny_model_dir

    base = str(tiny_model_dir())
    torch.manual_seed(0)
    model = ScalarModel.from_pretrained(base, dtype=torch.float32, flag="--reward_pretrain")
    out = tmp_path_factory.mktemp("rm") / "tiny-rm"
    save_hf_folder(model, None, load_tokenizer(base), out, extra_config={"value_mean": 0.25, "value_std": 2.0})
    return out
