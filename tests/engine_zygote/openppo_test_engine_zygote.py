"""The test session's Ray cluster: Ray's workers, and vLLM's engine cores, fork from Pythons that have imported what
they import.

(Imported by this folder's `sitecustomize` in every Python process of the cluster; a module of its own, under a name
no other package takes, so that the zygotes' children find its functions whatever `sitecustomize` is elsewhere.)

A new Python spends ~15 CPU-seconds importing torch, transformers, DeepSpeed and vLLM before a trainer rank's or an
engine actor's first line runs, and ~17 before an engine core's (vLLM's spawn start, its choice in a Ray actor and on
CPU); the suite starts them by the dozen on a 2-core box. tests/ray_cluster.py starts two zygotes per test worker
(multiprocessing's fork server, `tests.engine_zygote.Zygote`): one with vLLM's engine-core modules imported, one with
what Ray's workers import, less Ray itself. It puts this folder on the cluster's PYTHONPATH, so that Python imports
this module in every process of the cluster:

- a Python the raylet starts for a worker (OPENPPO_TEST_RAY_WORKER_ZYGOTE_ADDRESS set) hands its worker over to a
  child of the Ray workers' zygote, and stays as its stand-in: it passes its signals on, exits as the child does, and
  the child exits when it dies. The child takes the stand-in's environment, standard streams, working directory and
  sys.path, then runs Ray's worker program as `__main__` and ends as a Python does (atexit hooks). The raylet knows
  workers by the token it gave them, so the pid the child registers with is the worker's. A worker with a runtime_env
  is handed over by Ray's setup_worker.py, with the runtime_env's variables set, instead of by the Python that
  setup_worker would exec;
- in a process with OPENPPO_TEST_ENGINE_ZYGOTE_ADDRESS set, a spawned process whose target is vLLM's engine core
  comes from the engine cores' zygote. The child gets what a spawned one gets: the parent's pickled preparation data
  (sys.path, working directory, main module) and process object, the parent's environment as it was at `start()`
  (OMP_NUM_THREADS and the thread count it sets, VLLM_CPU_OMP_THREADS_BIND, the Ray node), and the parent's stdout
  and stderr (the actor's log, which Ray streams to the driver). The parent holds a `Popen` of multiprocessing's own
  fork-server kind: pid, exit code, `terminate`, `kill` and the sentinel that vLLM's client watches work as for a
  spawned child. The child is not the parent's child, so it watches its parent itself and exits when it dies (Ray
  kills a dead actor's children; here the child does it).

An engine core's tensor-parallel workers (vLLM's multiprocessing executor, spawned by the engine core) come from the
same zygote, the same way: the engine core is the process that asks. The two-node cluster (tests/two_nodes.py) has a
pair of zygotes per node. The spawn start stays covered: the clusters other tests start themselves (fake GPUs, killed
runs) keep it, and so do the engines of the tests that check the process tree users get
(`tests.engine_zygote.SPAWNED`); OPENPPO_TEST_ENGINE_ZYGOTE=0 in the session's environment turns both zygotes off for
the test clusters too, OPENPPO_TEST_RAY_WORKER_ZYGOTE=0 the Ray workers'.
"""

from __future__ import annotations

import multiprocessing.context
import os

ADDRESS_ENV = "OPENPPO_TEST_ENGINE_ZYGOTE_ADDRESS"  # the engine cores' zygote's socket
RAY_WORKER_ADDRESS_ENV = "OPENPPO_TEST_RAY_WORKER_ZYGOTE_ADDRESS"  # the socket of Ray's workers' zygote
SERVER_ENV = "OPENPPO_TEST_ENGINE_ZYGOTE_SERVER"  # set in a zygote itself, which hands nothing over
# the targets' modules: EngineCoreProc.run_engine_core, and WorkerProc.worker_main (a tensor-parallel worker)
_ENGINE_MODULES = ("vllm.v1.engine.", "vllm.v1.executor.multiproc_executor")
RAY_WORKER_MAIN = os.path.join("ray", "_private", "workers", "default_worker.py")
RAY_SETUP_WORKER = os.path.join("ray", "_private", "workers", "setup_worker.py")  # (a worker with a runtime_env)


def _adopt(env: dict[str, str], fds: tuple[int, ...]) -> None:
    """A zygote child's first step: the standard streams (`fds`, sent last by `_launch`), environment and thread count
    of the process that asked for it, as a spawned child would have them, and a watch on that process."""
    import multiprocessing
    import signal
    import sys
    import threading
    from multiprocessing import forkserver
    from multiprocessing.connection import wait

    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    for fd, inherited in zip(fds, forkserver.get_inherited_fds()[-len(fds) :]):
        os.dup2(inherited, fd)
        os.close(inherited)
    try:  # setproctitle finds the memory it writes the title to from the C environment, which the next lines replace
        import setproctitle

        setproctitle.getproctitle()
    except ImportError:
        pass
    os.environ.clear()
    os.environ.update(env)
    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:  # a new Python's OpenMP runtime reads it as it loads
        import torch

        torch.set_num_threads(int(threads))
    sentinel = multiprocessing.parent_process().sentinel

    def watch() -> None:
        wait([sentinel])
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="zygote-parent-watch", daemon=True).start()


def _in_parent_env(env: dict[str, str], target, *args, **kwargs) -> None:
    """An engine core's or a tensor-parallel worker's first step (`_adopt`), then vLLM's target, then the end of a
    spawned child (`_exit_as_spawned`)."""
    import traceback

    _adopt(env, (1, 2))
    if env.get(ADDRESS_ENV):
        _install(env[ADDRESS_ENV])  # (an engine core's workers fork from the zygote, as its own process did)
    try:
        target(*args, **kwargs)
        code = 0
    except SystemExit as end:  # multiprocessing's rule for a child's exit code
        code = end.code if isinstance(end.code, int) else int(end.code is not None)
    except BaseException:
        traceback.print_exc()
        code = 1
    _exit_as_spawned(code)


def _exit_as_spawned(code: int) -> None:
    """End this process as a spawned multiprocessing child ends, not as a fork-server child (`os._exit`, right after
    its target): multiprocessing's finalizers, the other threads joined, the `atexit` hooks, the streams flushed, and
    then the C library's `exit`, which runs the C++ static destructors. vLLM's CPU shared-memory communicator (its
    AVX512 build: `_C_AVX512`) unlinks its /dev/shm files (`vllm_dist_*-cpushm_*`, 4 MiB each) in one; ended with
    `os._exit`, a tensor-parallel engine's workers left them behind on every AVX512 CPU."""
    import atexit
    import ctypes
    import threading
    from multiprocessing import util

    util._exit_function()
    threading._shutdown()
    atexit._run_exitfuncs()
    util._flush_std_streams()
    ctypes.CDLL(None).exit(code)


def _ray_worker(env: dict[str, str], argv: list[str]) -> None:
    """A Ray worker's life in a zygote child: `_adopt`, then Ray's worker program as `__main__` with the arguments
    the raylet gave (the working directory and sys.path came with the preparation data), then what a Python does as
    it ends (a multiprocessing child ends with `os._exit`, which runs no `atexit` hook)."""
    import atexit
    import runpy
    import sys
    import threading

    _adopt(env, (0, 1, 2))
    if env.get(ADDRESS_ENV):
        _install(env[ADDRESS_ENV])  # (this process's engine cores fork from their zygote, as the stand-in's would)
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(argv[0]))  # what Python puts first for a script, after `sitecustomize` ran
    try:
        runpy.run_path(argv[0], run_name="__main__")
    finally:
        threading._shutdown()  # the non-daemon threads first, then the hooks, as Python's own finalization
        atexit._run_exitfuncs()


def _zygote_popen(address: str, stdio: tuple[int, ...]):
    """multiprocessing's fork-server `Popen`, for the zygote at `address`; the child gets this process's `stdio`."""
    import io
    from multiprocessing import context, forkserver, popen_forkserver, reduction, resource_tracker, spawn, util

    class Zygote(forkserver.ForkServer):
        """multiprocessing's fork-server client, for a server this process did not start."""

        def __init__(self) -> None:
            super().__init__()
            self._forkserver_address = address
            self._forkserver_alive_fd = os.open(os.devnull, os.O_RDONLY)  # (children that start fork servers)

        def ensure_running(self) -> None:
            resource_tracker.ensure_running()

    zygote = Zygote()

    class ZygotePopen(popen_forkserver.Popen):
        """popen_forkserver.Popen's launch, through the zygote."""

        def _launch(self, process_obj) -> None:
            prep_data = spawn.get_preparation_data(process_obj._name)
            buf = io.BytesIO()
            context.set_spawning_popen(self)
            try:
                reduction.dump(prep_data, buf)
                reduction.dump(process_obj, buf)
            finally:
                context.set_spawning_popen(None)
            self.sentinel, w = zygote.connect_to_new_process([*self._fds, *stdio])
            parent_w = os.dup(w)  # the child's sentinel of this process: closed when this process ends
            self.finalizer = util.Finalize(self, util.close_fds, (parent_w, self.sentinel))
            with open(w, "wb", closefd=True) as f:
                f.write(buf.getbuffer())
            self.pid = forkserver.read_signed(self.sentinel)

    return ZygotePopen


def _install(address: str) -> None:
    """Spawned processes whose target is vLLM's engine core or a tensor-parallel worker come from the zygote at
    `address`."""
    import functools
    from multiprocessing import context

    zygote_popen = _zygote_popen(address, (1, 2))
    spawn_popen = context.SpawnProcess._Popen

    def popen(process_obj):
        target = process_obj._target
        if not getattr(target, "__module__", "").startswith(_ENGINE_MODULES):
            return spawn_popen(process_obj)
        process_obj._target = functools.partial(_in_parent_env, dict(os.environ), target)
        return zygote_popen(process_obj)

    context.SpawnProcess._Popen = staticmethod(popen)


def _ray_worker_popen(process_obj):
    return _zygote_popen(os.environ[RAY_WORKER_ADDRESS_ENV], (0, 1, 2))(process_obj)


class _RayWorkerProcess(multiprocessing.context.SpawnProcess):
    """A Ray worker's process, from the zygote (a class of this module's: the process object is pickled for it)."""

    _Popen = staticmethod(_ray_worker_popen)


def _hand_over_ray_worker(env: dict[str, str], argv: list[str]) -> None:
    """In a new Python that the raylet started for a worker (`_ray_worker_launch`): the worker runs in a zygote child
    instead, with `env` and `argv`, and this process stays as its stand-in, passing on the signals it gets and exiting
    as the child does. Never returns."""
    import signal

    # named as a Ray worker's process is (vLLM puts the name in its log lines)
    worker = _RayWorkerProcess(target=_ray_worker, args=(env, argv), name="MainProcess")
    worker.start()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, _: os.kill(worker.pid, signum))
    worker.join()
    code = worker.exitcode
    if code is not None and code < 0:  # killed by a signal: end the same way
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code or 0)


def _ray_worker_launch() -> tuple[dict[str, str], list[str]] | None:
    """If the raylet started this Python for a worker: the environment and command line of Ray's worker program.
    A worker with a runtime_env starts as Ray's setup_worker.py, which sets the runtime_env's variables (`${VAR}`
    expanded, unset ones empty: Ray's `update_envs`) and execs a new Python for the worker program through bash; that
    Python (and setup_worker's import of Ray, 0.6 of the 0.8 CPU-s a stand-in took) is skipped by setting them here.
    None for any other Python, and for a runtime_env that asks setup_worker for more (a command prefix, another Python
    or entry point), which then runs as it does for users."""
    import sys

    if sys.argv and sys.argv[0].endswith(RAY_WORKER_MAIN):
        return dict(os.environ), list(sys.argv)
    if not (sys.argv and sys.argv[0].endswith(RAY_SETUP_WORKER)):
        return None
    import argparse
    import json
    import re

    parser = argparse.ArgumentParser(add_help=False)  # setup_worker.py's own options; the rest is the worker's
    parser.add_argument("--serialized-runtime-env-context")
    parser.add_argument("--language")
    args, argv = parser.parse_known_args(sys.argv[1:])
    context = json.loads(args.serialized_runtime_env_context or "{}")
    if (
        args.language != "PYTHON"
        or context.get("command_prefix")
        or context.get("py_executable") not in (None, sys.executable)
        or context.get("override_worker_entrypoint")
        or not (argv and argv[0].endswith(RAY_WORKER_MAIN))
    ):
        return None
    saved = dict(os.environ)
    try:  # set one by one, as Ray does: a value may name a variable set before it
        for key, value in (context.get("env_vars") or {}).items():
            os.environ[key] = re.sub(r"\$\{[A-Z0-9_]+\}", "", os.path.expandvars(value))
        return dict(os.environ), argv
    finally:  # (left as it was, for setup_worker.py itself if the worker is not handed over)
        os.environ.clear()
        os.environ.update(saved)


# Only as `sitecustomize` loads it at start-up: the tests import it as tests.engine_zygote.openppo_test_engine_zygote
# too, and so may an actor unpickling a test's function (a second hand-over there would end the actor)
if __name__ == "openppo_test_engine_zygote" and os.environ.get(SERVER_ENV) != "1":
    _launch = _ray_worker_launch() if os.environ.get(RAY_WORKER_ADDRESS_ENV) else None
    if _launch is not None and _launch[0].get(RAY_WORKER_ADDRESS_ENV):  # (a runtime_env may turn the zygote off)
        _hand_over_ray_worker(*_launch)
    if os.environ.get(ADDRESS_ENV):
        _install(os.environ[ADDRESS_ENV])
