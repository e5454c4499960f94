"""Killing a run's vLLM engine while it generates: the faults the engine-restart tests inject (a SIGKILL of the
engine's actor process and the engine core under it, or of vLLM's engine core alone), read from the driver's log and
/proc."""

from __future__ import annotations

import collections
import contextlib
import os
import re
import signal
import time

import psutil

# the driver's lines naming each engine's process: at start-up, and after each restart
_PID_LINES = re.compile(r"vLLM engine (\d+): (?:restarted in [\d.]+ s, )?pid (\d+)")
BUSY_SHARE = 0.5  # of one core over a sampling interval: the engine is generating
_SAMPLE_S = 0.02


def engine_pids(log: str, index: int = 0) -> list[int]:
    """The pids of engine `index`'s actor processes, in the order the driver's log names them: the first engine's,
    then each replacement's."""
    return [int(pid) for i, pid in _PID_LINES.findall(log) if int(i) == index]


def engine_pid(log: str, index: int = 0) -> int:
    """The pid of engine `index`'s actor process now: the last one the driver's log names."""
    pids = engine_pids(log, index)
    assert pids, f"the log names no pid of vLLM engine {index}"
    return pids[-1]


def engine_core(actor_pid: int) -> psutil.Process | None:
    """vLLM's engine core process of an engine's actor (None when the core runs in the actor: partial rollouts): its
    child, or, forked from a test cluster's zygote (tests/engine_zygote), the engine core that writes to its stdout."""
    cores = [p for p in psutil.Process(actor_pid).children(recursive=True) if p.name() == "VLLM::EngineCore"]
    if not cores:
        log = os.readlink(f"/proc/{actor_pid}/fd/1")  # (the actor's own log file)
        for proc in psutil.process_iter(["name"]):
            with contextlib.suppress(OSError, psutil.Error):
                if proc.info["name"] == "VLLM::EngineCore" and os.readlink(f"/proc/{proc.pid}/fd/1") == log:
                    cores.append(proc)
    return cores[0] if cores else None


def _cpu_seconds(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def kill_while_generating(actor_pid: int, *, core: bool = False, busy_s: float = 0.06, timeout_s: float = 300.0) -> int:
    """SIGKILL an engine once it is generating: its actor process (and the engine core under it, as a real cluster
    does), or with `core` vLLM's engine core process alone. Generating is told by the process that decodes (the engine
    core, else the actor) using more than BUSY_SHARE of a core over the last `busy_s`, sampled every 20 ms: longer
    than the tiny model's weight sync keeps the engine busy, shorter than the generation the caller makes long enough
    for it. (Over a window, not in each sample: the kernel counts CPU time in 10-ms ticks, so a fully busy 20 ms
    reads as 10 ms now and then, which broke a run of busy samples in two.) Returns the pid killed."""
    worker = engine_core(actor_pid) or psutil.Process(actor_pid)
    victim = worker.pid if core else actor_pid
    assert not core or worker.pid != actor_pid, "this engine runs its engine core in its actor process"
    deadline = time.monotonic() + timeout_s
    samples = collections.deque([(time.monotonic(), _cpu_seconds(worker))])
    while time.monotonic() < deadline:
        time.sleep(_SAMPLE_S)
        samples.append((time.monotonic(), _cpu_seconds(worker)))
        while len(samples) > 2 and samples[-1][0] - samples[1][0] >= busy_s:
            samples.popleft()  # (the oldest sample that still spans `busy_s` stays first)
        (began, first), (now, last) = samples[0], samples[-1]
        if now - began >= busy_s and last - first > BUSY_SHARE * (now - began):
            os.kill(victim, signal.SIGKILL)
            if not core and worker.pid != actor_pid:
                # and the engine core under it, as a real cluster's raylet kills a dead worker's children (gone 0.3 s
                # after its actor, measured), closing its sockets: a weight sync under way fails at once. A test
                # cluster's processes forked from its zygotes escape the raylet; their core lived on and held the
                # sync's broadcast until --dist_timeout (the two-node test's job took 1228 s once).
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker.pid, signal.SIGKILL)
            return victim
    raise AssertionError(f"vLLM engine process {worker.pid} did not generate within {timeout_s:.0f} s")
