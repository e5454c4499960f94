"""The session cluster's engine-core zygote (see `openppo_test_engine_zygote` here): started by tests/ray_cluster.py."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

from tests.engine_zygote.openppo_test_engine_zygote import ADDRESS_ENV, SERVER_ENV

FOLDER = Path(__file__).parent  # on the cluster's PYTHONPATH, for its `sitecustomize`
# What an engine core imports: the module of its target, its executor, CPU worker and attention backend, the modules
# its model loader reaches, openppo's worker extension, and the main module of its parent, Ray's worker, which a
# spawned child imports as `__mp_main__` (the fork server imports it first when "__main__" leads the list). The fork
# server skips a name it cannot import: tests/rollout/test_engine_zygote.py checks that each one imports.
PRELOAD = (
    "__main__",
    "vllm.v1.engine.core",
    "vllm.v1.executor.uniproc_executor",
    "vllm.v1.worker.cpu_worker",
    "vllm.v1.attention.backends.cpu_attn",
    "vllm.model_executor.layers.quantization.online.base",
    "compressed_tensors",
    "openppo.rollout.worker_extension",
    "openppo_test_engine_zygote",  # (imported at start-up already, by `sitecustomize`)
)


# Options of an engine actor whose engine core is spawned even in the session's cluster: for the tests that check the
# process tree users get (the engine core a child of the actor, its workers children of the engine core)
SPAWNED = {"runtime_env": {"env_vars": {ADDRESS_ENV: ""}}}


def ray_worker_main() -> str:
    """The path of Ray's worker program, the `__main__` of the engine actors."""
    ray_dir = importlib.util.find_spec("ray").submodule_search_locations[0]
    return os.path.join(ray_dir, "_private", "workers", "default_worker.py")


class Zygote:
    """multiprocessing's fork server on a socket of its own, with `PRELOAD` imported, serving every process that
    connects (not only the one that started it). It ends when this process closes `close()` or ends."""

    def __init__(self, env: dict[str, str]):
        """`env`: the cluster's environment; `self.env` is it for the cluster's processes (and the server's own)."""
        self.address = os.path.join(tempfile.gettempdir(), f"openppo-zygote-{uuid.uuid4().hex[:12]}.sock")
        path = [str(FOLDER), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
        self.env = {**env, "PYTHONPATH": os.pathsep.join(path), ADDRESS_ENV: self.address}
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(self.address)
        os.chmod(self.address, 0o600)
        listener.listen()
        alive_r, self._alive_w = os.pipe()
        code = (
            "from multiprocessing.forkserver import main; "
            f"main({listener.fileno()}, {alive_r}, {list(PRELOAD)!r}, main_path={ray_worker_main()!r})"
        )
        self.log = tempfile.NamedTemporaryFile(prefix="openppo-zygote-", suffix=".log")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code],
            pass_fds=(listener.fileno(), alive_r),
            env={**self.env, SERVER_ENV: "1"},
            stdin=subprocess.DEVNULL,
            stdout=self.log,
            stderr=self.log,
        )
        listener.close()
        os.close(alive_r)

    def close(self) -> None:
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
