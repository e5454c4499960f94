"""A test cluster's zygotes, of vLLM's processes and of Ray's workers (see `openppo_test_engine_zygote` here): started
by tests/ray_cluster.py for the session cluster, and by tests/two_nodes.py for each of its nodes."""

from __future__ import annotations

import importlib.util
import os
import select
import socket
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

from tests.engine_zygote.openppo_test_engine_zygote import ADDRESS_ENV, RAY_WORKER_ADDRESS_ENV, SERVER_ENV

FOLDER = Path(__file__).parent  # on the cluster's PYTHONPATH, for its `sitecustomize`
# What an engine core imports: the module of its target, its executors (one process; tensor-parallel workers), CPU
# worker and attention backend, the modules its model loader reaches, openppo's worker extension, and the main module
# of its parent, Ray's worker, which a spawned child imports as `__mp_main__` (the fork server imports it first when
# "__main__" leads the list). The fork server skips a name it cannot import: tests/rollout/test_engine_zygote.py
# checks that each one imports.
PRELOAD = (
    "__main__",
    "vllm.v1.engine.core",
    "vllm.v1.executor.uniproc_executor",
    "vllm.v1.executor.multiproc_executor",
    "vllm.v1.worker.cpu_worker",
    "vllm.v1.attention.backends.cpu_attn",
    "vllm.model_executor.layers.quantization.online.base",
    "compressed_tensors",
    "openppo.rollout.worker_extension",
    "openppo_test_engine_zygote",  # (imported at start-up already, by `sitecustomize`)
)
# What Ray's workers of the suite import as their actors start (trainer ranks: torch, transformers' classes of the
# suite's models, DeepSpeed, peft; engine actors: vLLM), less Ray itself: Ray's C++ settings (RAY_JOB_ID, which the
# raylet gives each worker, above all) are read once, as Ray loads, so each child loads Ray itself. vLLM's `LLM`
# imports Ray (vllm.v1.executor.ray_utils): its modules that do not are listed, the rest is left to the child (0.5 of
# the 16 CPU-s all of it takes, measured on a 2-core AMD EPYC). tests/rollout/test_engine_zygote.py checks that each
# name imports and that none loads Ray.
RAY_WORKER_PRELOAD = (
    "torch",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.qwen3.modeling_qwen3",
    "deepspeed",
    "peft",
    "vllm",
    "vllm.engine.arg_utils",
    "vllm.outputs",
    "vllm.v1.engine.output_processor",
    "vllm.model_executor.models.qwen2",
    "openppo.distributed.worker",
    "openppo.ppo.workers",
    "openppo.rollout.engine",
    "openppo_test_engine_zygote",
)

READY_TIMEOUT_S = 600  # the imports of a zygote on a busy 2-core box take a minute or two

# Options of an engine actor whose engine core is spawned even in the session's cluster: for the tests that check the
# process tree users get (the engine core a child of the actor, its workers children of the engine core)
SPAWNED = {"runtime_env": {"env_vars": {ADDRESS_ENV: ""}}}


def ray_worker_main() -> str:
    """The path of Ray's worker program, the `__main__` of the engine actors."""
    ray_dir = importlib.util.find_spec("ray").submodule_search_locations[0]
    return os.path.join(ray_dir, "_private", "workers", "default_worker.py")


def for_cluster(env: dict[str, str], prefix: tuple[str, ...] = ()) -> Zygotes | None:
    """The zygotes of a test cluster whose processes get `env` (and run under the command `prefix`), unless the
    session's environment turns them off: OPENPPO_TEST_ENGINE_ZYGOTE=0 both, OPENPPO_TEST_RAY_WORKER_ZYGOTE=0 the
    one of Ray's workers."""
    if os.environ.get("OPENPPO_TEST_ENGINE_ZYGOTE") == "0":
        return None
    return Zygotes(env, ray_workers=os.environ.get("OPENPPO_TEST_RAY_WORKER_ZYGOTE") != "0", prefix=prefix)


class Zygotes:
    """A test cluster's zygotes: one for vLLM's engine cores and, with `ray_workers`, one for Ray's workers. `env`:
    the cluster's environment; `self.env` is it for the cluster's processes, which find the zygotes by it. `prefix`:
    the command they run under, the same as the node's (`ip netns exec NS` for a node in a network namespace of its
    own: a child has its zygote's namespaces)."""

    def __init__(self, env: dict[str, str], ray_workers: bool = True, prefix: tuple[str, ...] = ()):
        path = [str(FOLDER), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
        self.env = {**env, "PYTHONPATH": os.pathsep.join(path)}
        self.engine = Zygote(self.env, PRELOAD, main_path=ray_worker_main(), prefix=prefix)
        self.ray_worker = None
        try:
            if ray_workers:
                self.ray_worker = Zygote(self.env, RAY_WORKER_PRELOAD, without="ray", prefix=prefix)
            for zygote in (self.engine, self.ray_worker):  # (both import at once)
                if zygote is not None:
                    zygote.wait_ready()
        except BaseException:
            self.close()
            raise
        self.env[ADDRESS_ENV] = self.engine.address
        if self.ray_worker is not None:
            self.env[RAY_WORKER_ADDRESS_ENV] = self.ray_worker.address

    def close(self) -> None:
        for zygote in (self.engine, self.ray_worker):
            if zygote is not None:
                zygote.close()


class Zygote:
    """multiprocessing's fork server on a socket of its own, with `preload` imported, serving every process that
    connects (not only the one that started it). It ends when this process closes `close()` or ends."""

    def __init__(
        self,
        env: dict[str, str],
        preload: tuple[str, ...],
        main_path: str | None = None,
        without: str | None = None,
        prefix: tuple[str, ...] = (),
    ):
        """Starts it: `env`, its environment; `main_path`, what "__main__" in `preload` names; `without`, a module
        that the imports must not load (it refuses to start if they do); `prefix`, a command it runs under. Serves
        once `wait_ready` returned."""
        self.without = without
        self.address = os.path.join(tempfile.gettempdir(), f"openppo-zygote-{uuid.uuid4().hex[:12]}.sock")
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(self.address)
        os.chmod(self.address, 0o600)
        listener.listen()
        alive_r, self._alive_w = os.pipe()
        self._ready_r, ready_w = os.pipe()
        # The imports first, then one byte on `ready_w` (b"1", or b"0" if they loaded `without`), then the server's
        # loop (whose own imports are then cached): the raylet waits 60 s for a worker it starts, so the cluster starts
        # once the zygotes can serve. The objects the imports made are then frozen (`gc.freeze`, what Python's docs
        # advise before fork()): a child's full collection walked them all, ~640k with torch, transformers, DeepSpeed
        # and vLLM (0.6-0.8 CPU-s each time), and its first wrote to ~43k pages shared with the zygote (170 MB copied).
        code = (
            "import gc, os, sys\n"
            f"for name in {[name for name in preload if name != '__main__']!r}:\n"
            "    try:\n        __import__(name)\n    except ImportError:\n        pass\n"
            "gc.collect()\ngc.freeze()\n"
            f"os.write({ready_w}, b'0' if {without!r} in sys.modules else b'1')\nos.close({ready_w})\n"
            "from multiprocessing.forkserver import main\n"
            f"main({listener.fileno()}, {alive_r}, {list(preload)!r}, main_path={main_path!r})\n"
        )
        self.log = tempfile.NamedTemporaryFile(prefix="openppo-zygote-", suffix=".log")
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, "-c", code],
            pass_fds=(listener.fileno(), alive_r, ready_w),
            env={**env, SERVER_ENV: "1"},
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=self.log,
        )
        listener.close()
        os.close(alive_r)
        os.close(ready_w)

    def wait_ready(self) -> None:
        """Returns once its imports are done; raises if they loaded `without` or took over READY_TIMEOUT_S."""
        try:
            ready, _, _ = select.select([self._ready_r], [], [], READY_TIMEOUT_S)
            answer = os.read(self._ready_r, 1) if ready else b""
        finally:
            os.close(self._ready_r)
            self._ready_r = None
        if answer != b"1":
            self.close()
            why = f"its imports loaded {self.without}" if answer == b"0" else f"not ready in {READY_TIMEOUT_S} s"
            raise RuntimeError(
                f"a zygote of the test cluster did not start: {why} (OPENPPO_TEST_ENGINE_ZYGOTE=0 runs without it)"
            )

    def close(self) -> None:
        if self._ready_r is not None:
            os.close(self._ready_r)
            self._ready_r = None
        if self._alive_w is not None:
            os.close(self._alive_w)  # the server's loop ends
            self._alive_w = None
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.log.close()
        if os.path.exists(self.address):
            os.unlink(self.address)
