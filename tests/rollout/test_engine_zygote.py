"""The session cluster's engine-core zygote (tests/engine_zygote): an engine actor's engine core forked from it is
what a spawned one would be, and the zygote imported what it was asked to."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import time

import psutil
import pytest

from tests import ray_cluster
from tests.engine_zygote import FOLDER, PRELOAD, RAY_WORKER_PRELOAD
from tests.engines import shm_files_of, start_tiny_engine


def test_every_preloaded_module_imports(monkeypatch):
    """The fork server skips a name that fails to import without a word: a renamed module would cost every engine
    its import time again."""
    monkeypatch.syspath_prepend(str(FOLDER))  # as on the cluster's PYTHONPATH
    for name in PRELOAD:
        if name != "__main__":
            importlib.import_module(name)


def test_the_ray_worker_preload_imports_without_ray():
    """Each name of the Ray workers' zygote imports in a fresh Python, and none loads Ray (whose C++ settings a child
    must read from its own environment): a new import of Ray in one of them would stop the session's cluster."""
    code = (
        "import sys\n"
        f"for name in {list(RAY_WORKER_PRELOAD)!r}:\n"
        "    __import__(name)\n"
        "    assert 'ray' not in sys.modules, f'{name} imports Ray'\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(FOLDER), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("OPENPPO_TEST_ENGINE_ZYGOTE") == "0", reason="the zygote is off")
def test_an_engine_core_and_its_workers_from_the_zygote_are_what_spawned_ones_are():
    """A tensor-parallel engine: its engine core and both workers forked from the zygote, not children of the actor
    and of the core, each writing to the actor's stdout and stderr, generating, leaving nothing in /dev/shm when the
    engine shuts down, and gone once the actor is killed (Ray kills a dead actor's children; a forked process watches
    the process that asked for it itself)."""
    import ray

    ray_cluster.connect()
    try:
        zygote = psutil.Process(ray_cluster.engine_zygote_pid())
        before = {p.pid for p in zygote.children()}
        engine = start_tiny_engine(spawned=False, tensor_parallel_size=2)

        def pids(e):
            return os.getpid(), [p.pid for p in e.llm.llm_engine.engine_core.resources.engine_manager.processes]

        actor, [core] = ray.get(engine.__ray_call__.remote(pids), timeout=60)
        forked = {p.pid: p.name() for p in zygote.children() if p.pid not in before}
        workers = [pid for pid, name in forked.items() if name.startswith("VLLM::Worker")]
        assert forked[core] == "VLLM::EngineCore" and len(workers) == 2 and len(forked) == 3, forked
        children = [" ".join(p.cmdline()) for p in psutil.Process(actor).children(recursive=True)]
        assert all("resource_tracker" in child for child in children), children  # (multiprocessing's own)
        for pid in forked:
            for fd in (1, 2):
                assert os.readlink(f"/proc/{pid}/fd/{fd}") == os.readlink(f"/proc/{actor}/fd/{fd}")
        [[sample]] = ray.get(
            engine.generate.remote([[100, 101, 102]], n=1, max_new_tokens=4, temperature=1.0, top_p=1.0), timeout=120
        )
        assert len(sample["token_ids"]) == 4
        # shut down, they end as spawned ones do, and remove their shared memory: the message queues, and on an
        # AVX512 CPU vLLM's CPU communicator's files, which its C++ static destructors unlink
        held = set().union(*(shm_files_of(pid) for pid in forked))
        assert any("/psm_" in path for path in held), held
        ray.get(engine.shutdown.remote(), timeout=120)
        assert not [path for path in held if os.path.exists(path)], held
        ray.kill(engine)
        deadline = time.monotonic() + 60
        for pid in forked:
            while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                assert time.monotonic() < deadline, f"{forked[pid]} outlived its actor by 60 s"
                time.sleep(0.2)
    finally:
        ray.shutdown()


@pytest.mark.skipif(
    "0" in (os.environ.get("OPENPPO_TEST_ENGINE_ZYGOTE"), os.environ.get("OPENPPO_TEST_RAY_WORKER_ZYGOTE")),
    reason="the zygote of Ray's workers is off",
)
def test_a_ray_worker_runs_in_a_zygote_child_behind_a_stand_in():
    """An actor of the session cluster: its worker is a child of the zygote, with the modules the zygote imported, the
    environment its runtime_env gave (`${VAR}` expanded as Ray's setup_worker.py does) and the working directory Ray
    gave; the process the raylet started, Ray's setup_worker.py, is its stand-in (it never starts the Python that
    setup_worker would exec), and both are gone once the actor is killed."""
    import ray

    ray_cluster.connect()
    try:
        env_vars = {"OPENPPO_TEST_MARK": "7", "OPENPPO_TEST_MARKS": "${OPENPPO_TEST_MARK}${OPENPPO_TEST_UNSET}/$HOME"}

        @ray.remote(num_cpus=0, runtime_env={"env_vars": env_vars})
        class Probe:
            def facts(self) -> dict:
                import importlib
                import multiprocessing
                import sys

                # (as an actor unpickling a test's function may: the module's start-up hand-over must not run again)
                importlib.import_module("tests.engine_zygote.openppo_test_engine_zygote")
                return {
                    "pid": os.getpid(),
                    "ppid": os.getppid(),
                    "stand_in": multiprocessing.parent_process().pid,
                    "preloaded": [m for m in ("deepspeed", "vllm", "openppo.ppo.workers") if m in sys.modules],
                    "marks": (os.environ.get("OPENPPO_TEST_MARK"), os.environ.get("OPENPPO_TEST_MARKS")),
                    "name": multiprocessing.current_process().name,
                    "cwd": os.getcwd(),
                    "main": sys.modules["__main__"].__file__,
                }

        probe = Probe.remote()
        facts = ray.get(probe.facts.remote(), timeout=120)
        assert facts["ppid"] == ray_cluster.ray_worker_zygote_pid(), facts
        assert facts["preloaded"] == ["deepspeed", "vllm", "openppo.ppo.workers"], facts
        assert facts["marks"] == ("7", f"7/{os.environ['HOME']}") and facts["main"].endswith("default_worker.py"), facts
        assert facts["name"] == "MainProcess", facts
        stand_in = psutil.Process(facts["stand_in"])
        assert [os.path.basename(arg) for arg in stand_in.cmdline()[1:3]] == ["setup_worker.py", "default_worker.py"]
        assert facts["cwd"] == stand_in.cwd(), facts
        ray.kill(probe)
        deadline = time.monotonic() + 60
        for pid in (facts["pid"], stand_in.pid):
            while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                assert time.monotonic() < deadline, f"process {pid} outlived its killed actor by 60 s"
                time.sleep(0.2)
    finally:
        ray.shutdown()


def test_an_actor_that_exits_runs_its_atexit_hooks(tmp_path):
    """An actor ending by `exit_actor` ends its Python as a Ray worker does, hooks run, in the session's cluster
    with or without the zygote of Ray's workers (whose children would otherwise end without them)."""
    import ray

    ray_cluster.connect()
    try:

        @ray.remote(num_cpus=0)
        class Leaver:
            def leave(self, path: str) -> None:
                import atexit

                atexit.register(lambda: open(path, "w").write("ran"))
                ray.actor.exit_actor()

        leaver = Leaver.remote()
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(leaver.leave.remote(str(tmp_path / "hook")), timeout=120)
        deadline = time.monotonic() + 60
        while not (tmp_path / "hook").exists():
            assert time.monotonic() < deadline, "the actor's atexit hook did not run within 60 s of its exit"
            time.sleep(0.2)
        assert (tmp_path / "hook").read_text() == "ran"
    finally:
        ray.shutdown()
