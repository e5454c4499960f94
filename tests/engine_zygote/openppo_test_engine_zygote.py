"""The test session's Ray cluster: vLLM's engine cores fork from a Python that has imported vLLM already.

(Imported by this folder's `sitecustomize` in every Python process of the cluster; a module of its own, under a name
no other package takes, so that the zygote's children find `_in_parent_env` whatever `sitecustomize` is elsewhere.)

An engine actor starts vLLM's engine core with multiprocessing's spawn method (vLLM's choice in a Ray actor and on
CPU), and the new Python spends ~17 CPU-seconds importing vLLM before the engine core's first line runs; the suite
starts dozens of engines on a 2-core box. tests/ray_cluster.py starts one zygote per test worker (multiprocessing's
fork server, `tests.engine_zygote.Zygote`, with vLLM's engine-core modules imported) and puts this folder on the
cluster's PYTHONPATH, so that Python imports this module in every process of the cluster. In a process with
OPENPPO_TEST_ENGINE_ZYGOTE_ADDRESS set, a spawned process whose target is vLLM's engine core comes from the zygote:

- the child gets what a spawned one gets: the parent's pickled preparation data (sys.path, working directory, main
  module) and process object, the parent's environment as it was at `start()` (OMP_NUM_THREADS and the thread
  count it sets, VLLM_CPU_OMP_THREADS_BIND, the Ray node), and the parent's stdout and stderr (the actor's log,
  which Ray streams to the driver);
- the parent holds a `Popen` of multiprocessing's own fork-server kind: pid, exit code, `terminate`, `kill` and the
  sentinel that vLLM's client watches work as for a spawned child;
- the child is not the parent's child, so it watches its parent itself and exits when it dies (Ray kills a dead
  actor's children; here the child does it).

Tensor-parallel workers are still spawned by the engine core (children of it). The spawn start stays covered: the
clusters tests start themselves (two nodes, fake GPUs, killed runs) keep it, and so do the engines of the tests that
check the process tree users get (`tests.engine_zygote.SPAWNED`); OPENPPO_TEST_ENGINE_ZYGOTE=0 in the session's
environment turns the zygote off for the session's cluster too.
"""

from __future__ import annotations

import os

ADDRESS_ENV = "OPENPPO_TEST_ENGINE_ZYGOTE_ADDRESS"  # the zygote's socket
SERVER_ENV = "OPENPPO_TEST_ENGINE_ZYGOTE_SERVER"  # set in the zygote itself, whose children fork no engine cores
_ENGINE_CORE_MODULE = "vllm.v1.engine"  # the target's module: EngineCoreProc.run_engine_core


def _in_parent_env(env: dict[str, str], target, *args, **kwargs):
    """The child's first step: the environment, output and thread count a spawned child would have had, and a watch
    on its parent."""
    import multiprocessing
    import signal
    import sys
    import threading
    from multiprocessing import forkserver
    from multiprocessing.connection import wait

    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    for fd, inherited in zip((1, 2), forkserver.get_inherited_fds()[-2:]):  # the parent's, sent last (`_launch`)
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
    return target(*args, **kwargs)


def _install(address: str) -> None:
    import functools
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
            self.sentinel, w = zygote.connect_to_new_process([*self._fds, 1, 2])
            parent_w = os.dup(w)  # the child's sentinel of this process: closed when this process ends
            self.finalizer = util.Finalize(self, util.close_fds, (parent_w, self.sentinel))
            with open(w, "wb", closefd=True) as f:
                f.write(buf.getbuffer())
            self.pid = forkserver.read_signed(self.sentinel)

    spawn_popen = context.SpawnProcess._Popen

    def popen(process_obj):
        target = process_obj._target
        if not getattr(target, "__module__", "").startswith(_ENGINE_CORE_MODULE):
            return spawn_popen(process_obj)
        process_obj._target = functools.partial(_in_parent_env, dict(os.environ), target)
        return ZygotePopen(process_obj)

    context.SpawnProcess._Popen = staticmethod(popen)


if os.environ.get(ADDRESS_ENV) and os.environ.get(SERVER_ENV) != "1":
    _install(os.environ[ADDRESS_ENV])
