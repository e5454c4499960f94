"""CLI runs of one process forked from a Python that has imported the CLIs' libraries already.

`python -m openppo.cli.train_ppo_ray ...` spends ~10 CPU-seconds importing torch, transformers, datasets and ray
before its first line runs, and the suite starts dozens of such runs on a 2-core box. A test worker starts this
server once (`python -m tests.cli.preloaded`, with the environment the runs get: `helpers.cli_env()`); it imports
the CLI modules' dependencies, then forks one child per run. The child is what `python -m` would have been: its own
session, stdin from /dev/null, stdout and stderr to files, the run's working directory, environment and argv, the
module run as `__main__` by runpy, exiting through the interpreter's normal shutdown (atexit: Ray's and W&B's).

Only runs whose environment is the server's (up to `PER_RUN_VARS`, read when a run starts, not when a library is
imported: OMP_NUM_THREADS is read by the OpenMP runtime as it loads) come here: `helpers.run_cli` runs the others,
and every multi-rank run (torchrun starts its ranks itself), as subprocesses. Runs that a test kills or submits to
Ray jobs (`BackgroundRun`, `ray job submit`) start as users start them, so the plain start stays covered.

Protocol, one JSON line each way: the client sends {module, argv, env, cwd, stdout, stderr}; the server answers
{"pid"} once the child runs and {"rc"} once it ended (a negative signal number if a signal ended it, as subprocess).
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time

# Imported once by the server: the CLIs whose runs come here (their dependencies stay loaded; the modules themselves
# are dropped in each child, which runs its own as __main__ the way `python -m` does).
PRELOAD = ("openppo.cli.train_ppo_ray", "openppo.cli.train_sft", "openppo.cli.train_rm", "openppo.cli.train_dpo")
PER_RUN_VARS = frozenset({"RAY_ADDRESS"})  # may differ between runs of one server
START_TIMEOUT_S = 300  # the server's imports on a busy 2-core box


def _comparable(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in PER_RUN_VARS}


# -- the server (this module run as a program) ---------------------------------------------------------------------


def _serve() -> None:
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    requests = os.fdopen(os.dup(0), "r")
    os.dup2(2, 1)  # what an import prints goes to the server's log, not into the protocol
    before = dict(os.environ)
    for name in PRELOAD:
        importlib.import_module(name)
    # what the imports set in the environment (DS_ACCELERATOR): a fresh run's imports set the same
    added = {k: v for k, v in os.environ.items() if before.get(k) != v}
    channel.write(json.dumps({"ready": added}) + "\n")
    for line in requests:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            channel.close()
            requests.close()
            _child(request, added)  # never returns
        channel.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        channel.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")


def _child(request: dict, added: dict[str, str]) -> None:
    os.setsid()  # a process group of its own: a timeout kills the run and whatever it started
    for fd, path, flags in (
        (0, os.devnull, os.O_RDONLY),
        (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
        (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
    ):
        opened = os.open(path, flags, 0o644)
        os.dup2(opened, fd)
        os.close(opened)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update({**added, **request["env"]})
    module = request["module"]
    sys.modules.pop(module, None)  # run as __main__ only, as `python -m` does (runpy warns of a second copy)
    sys.argv = [module, *request["argv"]]  # runpy puts the module's path first
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # a fresh interpreter seeds numpy's global generator from the OS (Python's `random` reseeds itself at a fork);
    # its hash seed stays the server's: the runs of one worker share it
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    import runpy

    runpy.run_module(module, run_name="__main__", alter_sys=True)
    raise SystemExit(0)  # (an exception propagates to the top and ends this process with status 1, as python -m)


# -- the client (a test worker) --------------------------------------------------------------------------------------


class Preloaded:
    """One server and the runs it forks, one at a time (a test worker runs one test at a time)."""

    def __init__(self, env: dict[str, str], cwd: str):
        self.env = _comparable(env)
        self.log = tempfile.NamedTemporaryFile(prefix="openppo-preloaded-", suffix=".log")  # the server's stderr
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.cli.preloaded"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log,
            env=self.env,
            cwd=cwd,
            bufsize=0,
        )
        self._buffer = b""
        atexit.register(self.close)
        # what the server's imports set (DS_ACCELERATOR): the pytest process may have it or not, as a run's imports
        # set it either way
        self.added = self._read(time.monotonic() + START_TIMEOUT_S, "ready")

    def serves(self, env: dict[str, str]) -> bool:
        return self.proc.poll() is None and _comparable({**self.added, **env}) == {**self.added, **self.env}

    def run(self, module: str, argv: list[str], env: dict[str, str], cwd: str, timeout: float):
        """`python -m <module> argv` in a child: a CompletedProcess as `subprocess.run(capture_output=True,
        text=True)` gives, or subprocess.TimeoutExpired after `timeout` seconds (the child's group killed)."""
        cmd = [sys.executable, "-m", module, *argv]
        with tempfile.TemporaryDirectory(prefix="openppo-run-") as tmp:
            out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
            request = {"module": module, "argv": argv, "env": env, "cwd": cwd, "stdout": out, "stderr": err}
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            pid = self._read(time.monotonic() + 60, "pid")
            try:
                rc = self._read(time.monotonic() + timeout, "rc")
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):  # (ended meanwhile)
                    os.killpg(pid, signal.SIGKILL)
                self._read(time.monotonic() + 60, "rc")
                raise subprocess.TimeoutExpired(cmd, timeout, _text(out), _text(err)) from None
            return subprocess.CompletedProcess(cmd, rc, _text(out), _text(err))

    def _read(self, deadline: float, key: str):
        """The next line's `key`; the lines come from the pipe's file descriptor unbuffered, so none waits in a
        buffer that select cannot see (a run that fails at once sends its two lines together)."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the preloaded CLI server sent no {key!r} in time")
            if select.select([fd], [], [], left)[0]:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    self.log.seek(0)
                    tail = self.log.read()[-3000:].decode(errors="replace")
                    raise RuntimeError(f"the preloaded CLI server exited ({self.proc.wait()}) before {key!r}:\n{tail}")
                self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)[key]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def _text(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read()


_server: Preloaded | None = None


def server_for(env: dict[str, str], cwd: str) -> Preloaded | None:
    """This test worker's server for runs with `env` (started on first use, and again when the environment of the
    runs changed), or None with OPENPPO_TEST_PRELOADED=0."""
    global _server
    if os.environ.get("OPENPPO_TEST_PRELOADED", "1") == "0":
        return None
    if _server is not None and not _server.serves(env):  # an earlier test changed the environment for good
        _server.close()
        _server = None
    if _server is None:
        _server = Preloaded(env, cwd)
    return _server


if __name__ == "__main__":
    _serve()
