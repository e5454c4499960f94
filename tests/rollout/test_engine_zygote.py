"""The session cluster's engine-core zygote (tests/engine_zygote): an engine actor's engine core forked from it is
what a spawned one would be, and the zygote imported what it was asked to."""

from __future__ import annotations

import importlib
import os
import time

import psutil
import pytest

from tests import ray_cluster
from tests.engine_zygote import FOLDER, PRELOAD
from tests.engines import start_tiny_engine


def test_every_preloaded_module_imports(monkeypatch):
    """The fork server skips a name that fails to import without a word: a renamed module would cost every engine
    its import time again."""
    monkeypatch.syspath_prepend(str(FOLDER))  # as on the cluster's PYTHONPATH
    for name in PRELOAD:
        if name != "__main__":
            importlib.import_module(name)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("OPENPPO_TEST_ENGINE_ZYGOTE") == "0", reason="the zygote is off")
def test_an_engine_core_from_the_zygote_is_what_a_spawned_one_is():
    """Forked from the zygote: not the actor's child, writing to the actor's stdout and stderr, generating, and gone
    once the actor is killed (Ray kills a dead actor's children; the forked core watches its parent itself)."""
    import ray

    ray_cluster.connect()
    try:
        engine = start_tiny_engine(spawned=False)

        def pids(e):
            return os.getpid(), [p.pid for p in e.llm.llm_engine.engine_core.resources.engine_manager.processes]

        actor, [core] = ray.get(engine.__ray_call__.remote(pids), timeout=60)
        assert psutil.Process(core).ppid() != actor and core not in {p.pid for p in psutil.Process(actor).children()}
        assert psutil.Process(core).name() == "VLLM::EngineCore"
        for fd in (1, 2):
            assert os.readlink(f"/proc/{core}/fd/{fd}") == os.readlink(f"/proc/{actor}/fd/{fd}")
        [[sample]] = ray.get(
            engine.generate.remote([[100, 101, 102]], n=1, max_new_tokens=4, temperature=1.0, top_p=1.0), timeout=120
        )
        assert len(sample["token_ids"]) == 4
        ray.kill(engine)
        deadline = time.monotonic() + 60
        while psutil.pid_exists(core) and psutil.Process(core).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the engine core outlived its actor by 60 s"
            time.sleep(0.2)
    finally:
        ray.shutdown()
