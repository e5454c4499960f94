"""CLI runs (one process, or torchrun's ranks) forked from a Python that has imported the CLIs' libraries already.

`python -m openppo.cli.train_ppo_ray ...` spends ~10 CPU-seconds importing torch, transformers, datasets and ray
before its first line runs, and the suite starts dozens of such runs on a 2-core box. A test worker starts this
server once (`python -m tests.cli.preloaded`, with the environment the runs get: `helpers.cli_env()`); it imports
the CLI modules' dependencies, then forks one child per run. The child is what `python -m` would have been: its own
session, stdin from /dev/null, stdout and stderr to files, the run's working directory, environment and argv, the
module run as `__main__` by runpy, exiting through the interpreter's normal shutdown (atexit: Ray's and W&B's).

A run of N ranks (`torchrun --standalone --nproc_per_node N`) is N children, each with the variables torchrun 2.13
gives its ranks (`torchrun_env`, read off a real launch: RANK, LOCAL_RANK, WORLD_SIZE, the TORCHELASTIC_* ones) and
the rendezvous torchrun's ranks take: torch's `env://` start-up joins the agent's store as a client
(TORCHELASTIC_USE_AGENT_STORE), here a store the test worker serves on a port the OS picked. Their output goes to
one stdout and one stderr, as under torchrun; when one rank fails the others are stopped (SIGTERM, then SIGKILL
after `STOP_GRACE_S`) and the run's status is 1, torchrun's. tests/cli/test_launchers.py runs torchrun and
DeepSpeed's launcher themselves, so the launchers stay covered.

Only runs whose environment is the server's (up to `PER_RUN_VARS`, read when a run starts, not when a library is
imported: OMP_NUM_THREADS is read by the OpenMP runtime as it loads) come here: `helpers.run_cli` runs the others as
subprocesses. Runs that a test kills or submits to Ray jobs (`BackgroundRun`, `ray job submit`) start as users start
them, so the plain start stays covered.

Protocol, one JSON line each way: the client sends {module, argv, env, cwd, stdout, stderr, ranks} (`ranks`: each
rank's variables over `env`); the server answers {"pids"} once the children run and {"rc"} once they ended (one
process: a negative signal number if a signal ended it, as subprocess).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import uuid

from openppo.distributed.rendezvous import serve_store

# Imported once by the server: the CLIs whose runs come here and what their runs import, which the CLIs import in
# `train` (so that --help loads the config alone). These stay loaded; the CLI modules themselves are dropped in each
# child, which runs its own as __main__ the way `python -m` does.
PRELOAD = (
    "openppo.cli.train_ppo_ray",
    "openppo.cli.train_sft",
    "openppo.cli.train_rm",
    "openppo.cli.train_dpo",
    # train_ppo_ray's run
    "openppo.ppo.launch",
    "openppo.ppo.trainer",
    "openppo.ppo.reporting",
    "openppo.rewards",
    # the supervised CLIs' runs
    "openppo.datasets",
    "openppo.models.actor",
    "openppo.models.scalar",
    "openppo.models.vision",
    "openppo.trainers.setup",
    "openppo.trainers.loop",
    "openppo.trainers.stages",
)
PER_RUN_VARS = frozenset({"RAY_ADDRESS"})  # may differ between runs of one server
START_TIMEOUT_S = 300  # the server's imports on a busy 2-core box
STOP_GRACE_S = 30  # after one rank failed, how long the others get to end on SIGTERM


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
    gc.collect()
    gc.freeze()  # the imports' objects: the runs' collections skip them (tests/engine_zygote's zygotes do the same)
    # what the imports set in the environment (DS_ACCELERATOR): a fresh run's imports set the same
    added = {k: v for k, v in os.environ.items() if before.get(k) != v}
    channel.write(json.dumps({"ready": added}) + "\n")
    for line in requests:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        for path in (request["stdout"], request["stderr"]):
            open(path, "w").close()  # the ranks append to them
        pids = []
        for rank_env in request["ranks"]:
            pid = os.fork()
            if pid == 0:
                channel.close()
                requests.close()
                _child(request, {**added, **request["env"], **rank_env})  # never returns
            pids.append(pid)
        channel.write(json.dumps({"pids": pids}) + "\n")
        channel.write(json.dumps({"rc": _wait(pids)}) + "\n")


def _wait(pids: list[int]) -> int:
    """The run's status once every child ended: one child's own; for ranks, 0 or (one failed) 1, as torchrun's."""
    if len(pids) == 1:
        return os.waitstatus_to_exitcode(os.waitpid(pids[0], 0)[1])
    running, failed, stop_at = set(pids), False, None
    while running:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if failed and time.monotonic() > stop_at:
                _signal_groups(running, signal.SIGKILL)
            time.sleep(0.1)
            continue
        running.discard(pid)
        if os.waitstatus_to_exitcode(status) != 0 and not failed:
            failed, stop_at = True, time.monotonic() + STOP_GRACE_S
            _signal_groups(running, signal.SIGTERM)
    return int(failed)


def _signal_groups(pids, sig: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, sig)


def _child(request: dict, env: dict[str, str]) -> None:
    os.setsid()  # a process group of its own: a timeout kills the run and whatever it started
    for fd, path, flags in (
        (0, os.devnull, os.O_RDONLY),
        (1, request["stdout"], os.O_WRONLY | os.O_APPEND),
        (2, request["stderr"], os.O_WRONLY | os.O_APPEND),
    ):
        opened = os.open(path, flags)
        os.dup2(opened, fd)
        os.close(opened)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(env)
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

    def run(self, module: str, argv: list[str], env: dict[str, str], cwd: str, timeout: float, nproc: int = 1):
        """`python -m <module> argv` in a child (`nproc` > 1: `torchrun --standalone --nproc_per_node nproc -m
        <module> argv`, in `nproc` children): a CompletedProcess as `subprocess.run(capture_output=True, text=True)`
        gives, or subprocess.TimeoutExpired after `timeout` seconds (the children's groups killed)."""
        cmd = [sys.executable, "-m", module, *argv]
        if nproc > 1:
            cmd[1:3] = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", "-m", module]
        store = serve_store("localhost", 0, nproc, timeout) if nproc > 1 else None  # torchrun's agent store
        with tempfile.TemporaryDirectory(prefix="openppo-run-") as tmp:
            out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
            run_id = str(uuid.uuid4())
            ranks = [torchrun_env(r, nproc, store.port, run_id, tmp) for r in range(nproc)] if store else [{}]
            request = {"module": module, "argv": argv, "env": env, "cwd": cwd, "stdout": out, "stderr": err}
            self.proc.stdin.write(json.dumps({**request, "ranks": ranks}).encode() + b"\n")
            pids = self._read(time.monotonic() + 60, "pids")
            try:
                rc = self._read(time.monotonic() + timeout, "rc")
            except TimeoutError:
                _signal_groups(pids, signal.SIGKILL)
                self._read(time.monotonic() + 60, "rc")
                raise subprocess.TimeoutExpired(cmd, timeout, _text(out), _text(err)) from None
            finally:
                del store
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


def torchrun_env(rank: int, nproc: int, port: int, run_id: str, tmp: str) -> dict[str, str]:
    """What `torchrun --standalone --nproc_per_node nproc` (torch 2.13) sets for local rank `rank`, over its own
    environment, with its agent's store at localhost:`port`."""
    os.makedirs(error_dir := os.path.join(tmp, str(rank)), exist_ok=True)
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "GROUP_RANK": "0",
        "ROLE_RANK": str(rank),
        "ROLE_NAME": "default",
        "LOCAL_WORLD_SIZE": str(nproc),
        "WORLD_SIZE": str(nproc),
        "GROUP_WORLD_SIZE": "1",
        "ROLE_WORLD_SIZE": str(nproc),
        "MASTER_ADDR": "localhost",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_ERROR_FILE": os.path.join(error_dir, "error.json"),
        "TORCHELASTIC_SIGNALS_TO_HANDLE": "SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
    }


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
