"""The last lines a Ray worker wrote, for error messages about a rank that failed, died or hangs, and which of a
run's stand-alone actors (the vLLM engines) died.

Ray 2.60 sends every worker's stdout and stderr to `<session>/logs/worker-<worker id>-<job>-<pid>.out|.err` on
the worker's node; the files outlive the process, so they also hold what a crashed worker printed last (an
`os._exit`, a segfault, the OOM killer leave no Python traceback anywhere else). Each worker reports its two
paths at start-up (`BaseWorker.ping`). The driver reads them directly when they are on its own file system and
otherwise runs a zero-CPU task pinned to the worker's node to read them there.

A `WorkerGroup` watches its own ranks. The engines are plain actors that several callers use (the driver
generates on them, actor rank 0 broadcasts weights to them), so when one dies the first error can surface
anywhere: a failed `generate`, a weight sync that lost its peer, a rank of the actor group. Whatever failed, the
driver then asks every engine whether it is alive; a dead one is the root cause, and the run stops with an error
naming it, its process and the last lines it logged (read from its Ray log files, which outlive it).
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Sequence
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from openppo.errors import RunFailure, headline

# Ray writes marker lines (`:job_id:01000000`, `:actor_name:Foo`) into the files to route them to the driver.
_RAY_MARKER = re.compile(r"^:\w+:")
_TAIL_BYTES = 64 * 1024


def std_log_files() -> list[str]:
    """The files Ray redirected this process's stdout and stderr to (Linux: read from /proc)."""
    files = []
    for fd in (1, 2):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("/") and not target.startswith("/dev/") and target not in files:
            files.append(target)
    return files


def actor_location() -> dict:
    """Where the calling Ray actor runs (pid, node_ip, node_id, actor_id, log_files, gpu_ids): what an error about it
    names, and what the weight sync reads to tell which processes share a GPU."""
    ctx = ray.get_runtime_context()
    return {
        "pid": os.getpid(),
        "node_ip": ray.util.get_node_ip_address(),
        "node_id": ctx.get_node_id(),
        "actor_id": ctx.get_actor_id(),
        "log_files": std_log_files(),
        "gpu_ids": [str(g) for g in ctx.get_accelerator_ids().get("GPU", [])],
    }


def tail_file(path: str, n: int) -> list[str]:
    """The last `n` lines of a text file (reads at most its last 64 KiB), without Ray's marker lines."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - _TAIL_BYTES))
        text = f.read().decode("utf-8", errors="replace")
    lines = [line for line in text.splitlines() if line.strip() and not _RAY_MARKER.match(line)]
    return lines[-n:] if n > 0 else []


def tail_files(paths: list[str], n: int) -> dict[str, list[str]]:
    """`{path: last n lines}` for the paths that exist here."""
    return {p: tail_file(p, n) for p in paths if os.path.isfile(p)}


@ray.remote(num_cpus=0, max_retries=0)
def _tail_files_task(paths: list[str], n: int) -> dict[str, list[str]]:
    return tail_files(paths, n)


def read_log_tail(paths: list[str], node_id: str | None, n: int, timeout_s: float) -> dict[str, list[str]]:
    """The last `n` lines of each log file, read here if this host sees them, else on node `node_id`."""
    if not paths:
        return {}
    local = tail_files(paths, n)
    if local or node_id is None:
        return local
    task = _tail_files_task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))
    ref = task.remote(paths, n)
    try:
        return ray.get(ref, timeout=timeout_s)
    except Exception:  # a dead node or a busy cluster: the error message goes out without the tail
        with contextlib.suppress(Exception):
            ray.cancel(ref, force=True)
        return {}


def format_log_tail(tails: dict[str, list[str]]) -> str:
    """Log tails as one block, stdout before stderr (the traceback of a crash is usually last in stderr)."""
    parts = []
    for path in sorted(tails, key=lambda p: p.endswith(".err")):
        lines = tails[path]
        if lines:
            stream = "stderr" if path.endswith(".err") else "stdout"
            parts.append(f"--- last {len(lines)} lines of {stream} ({path}) ---\n" + "\n".join(lines))
    return "\n".join(parts)


# -- the run's stand-alone actors ---------------------------------------------------------------------------------

LOG_TAIL_LINES = 20
# An engine in the middle of a long request does not answer a probe at once; that is not death.
PROBE_TIMEOUT_S = 10.0


class ActorDiedError(RunFailure):
    """A stand-alone actor of the run died; the message names it and shows its last log lines."""


def actor_infos(actors: Sequence[Any], timeout_s: float) -> list[dict[str, Any]]:
    """Each actor's `info()` (pid, node_ip, node_id, actor_id, log_files), asked once at start-up."""
    return ray.get([a.info.remote() for a in actors], timeout=timeout_s)


def find_dead(
    actors: Sequence[Any], infos: Sequence[dict[str, Any]], kind: str, probe_timeout_s: float = PROBE_TIMEOUT_S
) -> ActorDiedError | None:
    """An `ActorDiedError` for the first of `actors` that is dead (asked all at once, bounded), else None.

    `kind` names them in the message ("vLLM engine"); `infos` come from `actor_infos`.
    """
    for index, died in dead_actors(actors, probe_timeout_s).items():
        return died_error(kind, index, infos[index], died)
    return None


def dead_actors(actors: Sequence[Any], probe_timeout_s: float = PROBE_TIMEOUT_S) -> dict[int, Exception]:
    """{index: Ray's error} of the `actors` that are dead, asked all at once with their `ready()` and waited for at
    most `probe_timeout_s` (an actor still busy after that counts as alive)."""
    probes = [a.ready.remote() for a in actors]
    ray.wait(probes, num_returns=len(probes), timeout=probe_timeout_s)
    dead = {}
    for index, probe in enumerate(probes):
        try:
            ray.get(probe, timeout=0)
        except ray.exceptions.RayActorError as died:
            dead[index] = died
        except Exception:  # still busy (GetTimeoutError) or raised: alive
            continue
    return dead


def died_error(kind: str, index: int, info: dict[str, Any], error: Exception, why: str = "") -> ActorDiedError:
    """The error that stops the run for a dead actor: what it was, where, Ray's cause, its last log lines; `why`
    says why the run stops rather than replacing it (when it could)."""
    tails = read_log_tail(info.get("log_files", []), info.get("node_id"), LOG_TAIL_LINES, PROBE_TIMEOUT_S)
    tail = format_log_tail(tails) or "(its log files could not be read)"
    cause = headline(error)
    return ActorDiedError(
        f"{kind} {index} (actor {info.get('actor_id')}, pid {info.get('pid')} on {info.get('node_ip')}) died; "
        f"the run was stopped{why}. Ray says: {cause}\n{tail}\n"
        f"Checkpoints already committed in --ckpt_path are intact: resume with --load_checkpoint."
    )
