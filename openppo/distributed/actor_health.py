"""Which of a run's stand-alone actors (the vLLM engines) died, for the error that stops the run.

A `WorkerGroup` watches its own ranks. The engines are plain actors that several callers use (the driver
generates on them, actor rank 0 broadcasts weights to them), so when one dies the first error can surface
anywhere: a failed `generate`, a weight sync that lost its peer, a rank of the actor group. Whatever failed, the
driver then asks every engine whether it is alive; a dead one is the root cause, and the run stops with an error
naming it, its process and the last lines it logged (read from its Ray log files, which outlive it).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import ray

from openppo.distributed.logs import format_log_tail, read_log_tail
from openppo.errors import RunFailure

logger = logging.getLogger(__name__)

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
    probes = [a.ready.remote() for a in actors]
    ray.wait(probes, num_returns=len(probes), timeout=probe_timeout_s)
    for index, (probe, info) in enumerate(zip(probes, infos)):
        try:
            ray.get(probe, timeout=0)
        except ray.exceptions.RayActorError as died:
            return _died(kind, index, info, died)
        except Exception:  # still busy (GetTimeoutError) or raised: alive
            continue
    return None


def _died(kind: str, index: int, info: dict[str, Any], error: Exception) -> ActorDiedError:
    tails = read_log_tail(info.get("log_files", []), info.get("node_id"), LOG_TAIL_LINES, PROBE_TIMEOUT_S)
    tail = format_log_tail(tails) or "(its log files could not be read)"
    cause = (str(error).strip().splitlines() or ["no details"])[0]
    return ActorDiedError(
        f"{kind} {index} (actor {info.get('actor_id')}, pid {info.get('pid')} on {info.get('node_ip')}) died; "
        f"the run was stopped. Ray says: {cause}\n{tail}\n"
        f"Checkpoints already committed in --ckpt_path are intact: resume with --load_checkpoint."
    )
