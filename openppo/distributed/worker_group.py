"""A group of Ray actors that form one torch.distributed world (one DeepSpeed model: actor, critic, reference...).

The driver talks to the group, never to single actors: `run` calls a method on every rank and waits,
`run_sharded` hands rank i its own shard. Every wait is bounded by the group's `timeout_s`. The first rank that
raises, dies or runs out of time fails the call with a `WorkerGroupError` naming the group, the rank, the actor
and the last lines that actor logged; the group then kills all its actors, because the other ranks are most
likely blocked in a collective waiting for the one that failed and would otherwise hang until their own
distributed timeout (10 minutes by default), which is what users of RLHF trainers most often report.

Start-up, in order:
1. one actor per rank, rank i in bundle `bundle_offset + i` of the placement group (the group makes its own, with
   `strategy`, when none is given). Each actor starts with RANK, WORLD_SIZE, LOCAL_RANK=0 (on GPUs Ray gives each actor
   its own CUDA_VISIBLE_DEVICES, so its device is always 0), OMP_NUM_THREADS (from its CPU share) and the
   caller's `env` already set, so libraries that read the environment at import time see them;
2. once all actors answer, rank 0 serves the group's rendezvous store on a port of its node (`rendezvous`: bound
   before anyone is told it, so no other process can take it): MASTER_ADDR, MASTER_PORT, LOCAL_WORLD_SIZE (ranks
   of this group on the same node) and `rendezvous.STORE_ENV` are then set in every actor before any user method
   runs (`connect`; with `wait=False` the constructor stops after step 1, so that several groups start side by
   side).
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from openppo.distributed.logs import format_log_tail, read_log_tail
from openppo.distributed.placement import make_placement_group
from openppo.distributed.rendezvous import STORE_ENV
from openppo.distributed.worker import GROUP_NAME_ENV, BaseWorker
from openppo.errors import RunFailure

logger = logging.getLogger(__name__)

Method = Callable | str  # a worker-class method, or its name

# Bound on the extra calls made while reporting a failure (reading a log tail, asking a live actor for its lines).
_DIAGNOSE_TIMEOUT_S = 10.0
LOG_TAIL_LINES = 20
# After a rank raises, how long to wait for news that another rank died (the more likely root cause).
_ROOT_CAUSE_GRACE_S = 2.0


class WorkerGroupError(RunFailure):
    """A rank of a worker group raised, died or did not answer in time; the group has been shut down."""

    def __init__(self, message: str, *, group: str, rank: int, actor: str, log_tail: str, died: bool = False):
        super().__init__(message)
        self.group = group
        self.rank = rank
        self.actor = actor
        self.log_tail = log_tail
        self.died = died  # the rank's process is gone (killed, its node lost), rather than raised or stuck


class WorkerGroup:
    """`num_workers` Ray actors of `worker_cls` (a `BaseWorker` subclass) forming one distributed world."""

    def __init__(
        self,
        worker_cls: type,
        num_workers: int,
        *,
        placement_group: PlacementGroup | None = None,
        bundle_offset: int = 0,
        strategy: str = "PACK",
        num_cpus_per_worker: float = 1.0,
        num_gpus_per_worker: float = 0.0,
        env: dict[str, str] | None = None,
        name: str = "workers",
        timeout_s: float = 600.0,
        init_args: Sequence[Any] = (),
        init_kwargs: dict[str, Any] | None = None,
        wait: bool = True,
    ):
        """`wait=False` returns once the actors are asked for (start-up step 1): several groups then start side by
        side, and each is usable after its `connect()` (step 2). `strategy` places the placement group the group
        makes itself (`placement.STRATEGIES`), when it is given none."""
        if not (isinstance(worker_cls, type) and issubclass(worker_cls, BaseWorker)):
            raise TypeError(
                f"worker group {name!r}: worker_cls must be a plain subclass of BaseWorker (not a "
                f"ray.remote class), got {worker_cls!r}"
            )
        if num_workers < 1:
            raise ValueError(f"worker group {name!r}: num_workers must be >= 1, got {num_workers}")
        if num_cpus_per_worker < 0 or num_gpus_per_worker < 0:
            raise ValueError(f"worker group {name!r}: resources per worker must be >= 0")
        if timeout_s <= 0:
            raise ValueError(f"worker group {name!r}: timeout_s must be > 0, got {timeout_s}")
        if placement_group is not None and not 0 <= bundle_offset <= placement_group.bundle_count - num_workers:
            raise ValueError(
                f"worker group {name!r}: {num_workers} workers from bundle {bundle_offset} do not fit "
                f"a placement group of {placement_group.bundle_count} bundles"
            )
        self.name = name
        self.worker_cls = worker_cls
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.master_addr: str | None = None
        self.master_port: int | None = None
        self._actors: list[Any] = []
        self._infos: list[dict[str, Any] | None] = [None] * num_workers
        self._pending: dict[str, tuple[int, str]] = {}  # ObjectRef hex -> (rank, method); no ref kept alive
        self._closed = False
        self._owns_placement_group = placement_group is None
        self.placement_group = placement_group
        self._t0 = time.monotonic()
        try:
            if self._owns_placement_group:
                self.placement_group = make_placement_group(
                    num_workers,
                    cpus_per_bundle=num_cpus_per_worker,
                    gpus_per_bundle=num_gpus_per_worker,
                    strategy=strategy,
                    timeout_s=self.timeout_s,
                    name=f"{name}-pg",
                )
                bundle_offset = 0
            self._launch(
                bundle_offset,
                num_cpus_per_worker,
                num_gpus_per_worker,
                dict(env or {}),
                tuple(init_args),
                dict(init_kwargs or {}),
            )
        except BaseException:
            self.shutdown()
            raise
        if wait:
            self.connect()

    def connect(self) -> None:
        """Start-up step 2 (the constructor does it unless `wait=False`): wait for every actor, then give them the
        group's rendezvous. A failure shuts the group down."""
        try:
            self._connect()
        except BaseException:
            self.shutdown()
            raise
        logger.info(
            "worker group %s: %d x %s ready in %.1f s (master %s:%s)",
            self.name,
            self.num_workers,
            self.worker_cls.__name__,
            time.monotonic() - self._t0,
            self.master_addr,
            self.master_port,
        )

    # --------------------------------------------------------------------------------------- start-up
    def _launch(
        self,
        bundle_offset: int,
        num_cpus: float,
        num_gpus: float,
        env: dict[str, str],
        init_args: tuple,
        init_kwargs: dict,
    ) -> None:
        remote_cls = ray.remote(self.worker_cls)
        token = uuid.uuid4().hex[:6]  # actor names must be unique in the namespace, also across restarts
        for rank in range(self.num_workers):
            rank_env = {"OMP_NUM_THREADS": str(max(1, math.floor(num_cpus)))}
            rank_env.update({k: str(v) for k, v in env.items()})
            rank_env.update(
                {"RANK": str(rank), "WORLD_SIZE": str(self.num_workers), "LOCAL_RANK": "0", GROUP_NAME_ENV: self.name}
            )
            strategy = PlacementGroupSchedulingStrategy(
                self.placement_group, placement_group_bundle_index=bundle_offset + rank
            )
            actor = remote_cls.options(
                num_cpus=num_cpus,
                num_gpus=num_gpus,
                scheduling_strategy=strategy,
                runtime_env={"env_vars": rank_env},
                name=f"{self.name}-{token}-rank{rank}",
                max_restarts=0,
            ).remote(*init_args, **init_kwargs)
            self._actors.append(actor)

    def _connect(self) -> None:
        self._infos = self._wait(self._submit("ping"), self.timeout_s, during="start-up")
        rank0 = self._infos[0]
        self.master_addr = rank0["node_ip"]
        serve = self._submit("serve_rendezvous", args=(self.master_addr, self.timeout_s), ranks=[0])
        self.master_port = self._wait(serve, self.timeout_s, during="start-up")[0]
        per_node: dict[str, int] = {}
        for info in self._infos:
            per_node[info["node_id"]] = per_node.get(info["node_id"], 0) + 1
        refs = []
        for rank, actor in enumerate(self._actors):
            dist_env = {
                "MASTER_ADDR": self.master_addr,
                "MASTER_PORT": str(self.master_port),
                "LOCAL_WORLD_SIZE": str(per_node[self._infos[rank]["node_id"]]),
                STORE_ENV: "1",
            }
            refs.append(self._track(actor.set_dist_env.remote(dist_env), rank, "set_dist_env"))
        self._wait(refs, self.timeout_s, during="start-up")

    # --------------------------------------------------------------------------------------- calls
    @property
    def actors(self) -> list[Any]:
        """The actor handles, in rank order."""
        return list(self._actors)

    @property
    def worker_infos(self) -> list[dict[str, Any]]:
        """What each rank reported at start-up: pid, node_ip, node_id, actor_id, log_files, cuda_visible_devices."""
        return [dict(info or {}) for info in self._infos]

    def run(self, method: Method, *args, **kwargs) -> list:
        """Call `method(*args, **kwargs)` on every rank; the results in rank order.

        `method` is a method of the worker class (`group.run(ActorWorker.sync_weights, ...)`, which an editor
        follows to its code) or its name."""
        return self.get(self.run_async(method, *args, **kwargs))

    def run_async(self, method: Method, *args, **kwargs) -> list[ray.ObjectRef]:
        """Start `method` on every rank without waiting; pass the refs to `get`."""
        return self._submit(self._name(method), args=args, kwargs=kwargs)

    def run_sharded(self, method: Method, shards: Sequence[Any], **kwargs) -> list:
        """Call `method(shards[i], **kwargs)` on rank i; each shard is put in the object store once."""
        method_name = self._name(method)
        if len(shards) != self.num_workers:
            raise ValueError(
                f"worker group {self.name!r}: {len(shards)} shards for {self.num_workers} ranks; "
                f"give exactly one shard per rank"
            )
        self._check_open(method_name)
        # A top-level ObjectRef argument reaches the method as its value; only rank i fetches shard i.
        refs = [
            self._track(getattr(actor, method_name).remote(ray.put(shard), **kwargs), rank, method_name)
            for rank, (actor, shard) in enumerate(zip(self._actors, shards))
        ]
        return self.get(refs)

    def get(self, refs: Sequence[ray.ObjectRef], timeout_s: float | None = None) -> list:
        """Wait for `refs` (from `run_async`), at most `timeout_s` (default: the group's); values in order.

        Fails at the first rank that raised or died, without waiting for the others.
        """
        return self._wait(list(refs), self.timeout_s if timeout_s is None else timeout_s, during=None)

    def shutdown(self) -> None:
        """Kill every actor (and the placement group the group made itself). Safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as e:  # already gone
                logger.debug("worker group %s: kill failed: %s", self.name, e)
        if self._owns_placement_group and self.placement_group is not None:
            try:
                remove_placement_group(self.placement_group)
            except Exception as e:
                logger.debug("worker group %s: removing its placement group failed: %s", self.name, e)
        self._pending.clear()

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        state = "shut down" if self._closed else f"master {self.master_addr}:{self.master_port}"
        return f"WorkerGroup({self.name!r}, {self.num_workers} x {self.worker_cls.__name__}, {state})"

    # --------------------------------------------------------------------------------------- internals
    def _name(self, method: Method) -> str:
        """The name to call on the actors; a function must be a method of the worker class or of a base class (an
        override in the worker class then runs, as a Python call would)."""
        if isinstance(method, str):
            return method
        name = getattr(method, "__name__", None)
        if name is None or not any(vars(cls).get(name) is method for cls in self.worker_cls.__mro__):
            raise AttributeError(
                f"worker group {self.name!r}: {method!r} is not a method of {self.worker_cls.__name__}"
            )
        return name

    def _check_open(self, method_name: str) -> None:
        if self._closed:
            raise RuntimeError(
                f"worker group {self.name!r} is shut down (after an earlier failure or shutdown()); "
                f"cannot run {method_name!r}"
            )
        if not callable(getattr(self.worker_cls, method_name, None)):
            raise AttributeError(
                f"worker group {self.name!r}: {self.worker_cls.__name__} has no method {method_name!r}"
            )

    def _track(self, ref: ray.ObjectRef, rank: int, method_name: str) -> ray.ObjectRef:
        self._pending[ref.hex()] = (rank, method_name)
        return ref

    def _submit(
        self, method_name: str, *, args: tuple = (), kwargs: dict | None = None, ranks: Sequence[int] | None = None
    ) -> list[ray.ObjectRef]:
        self._check_open(method_name)
        ranks = range(self.num_workers) if ranks is None else ranks
        return [
            self._track(getattr(self._actors[r], method_name).remote(*args, **(kwargs or {})), r, method_name)
            for r in ranks
        ]

    def _wait(self, refs: list[ray.ObjectRef], timeout_s: float, during: str | None) -> list:
        deadline = time.monotonic() + timeout_s
        values: dict[str, Any] = {}
        pending = list(refs)
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._fail_timeout([r.hex() for r in pending], timeout_s, during)
            ready, pending = ray.wait(pending, num_returns=1, timeout=remaining, fetch_local=True)
            for ref in ready:
                try:
                    values[ref.hex()] = ray.get(ref)
                except Exception as e:  # RayTaskError (the method raised) or RayActorError (the actor died)
                    ref, e, note = self._root_cause(ref, e, pending)
                    self._fail_error(ref.hex(), e, during, note)
        for ref in refs:
            self._pending.pop(ref.hex(), None)
        return [values[ref.hex()] for ref in refs]

    def _root_cause(
        self, ref: ray.ObjectRef, error: Exception, pending: list[ray.ObjectRef]
    ) -> tuple[ray.ObjectRef, Exception, str]:
        """Prefer a rank that died over one that raised: when a rank dies inside a collective its peers fail
        too (gloo: "Connection reset by peer"), and either report can reach the driver first.

        Returns the failure to report and a note on the one it replaced (empty if none).
        """
        if isinstance(error, ray.exceptions.RayActorError) or not pending:
            return ref, error, ""
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=_ROOT_CAUSE_GRACE_S, fetch_local=False)
        for other in ready:
            try:
                ray.get(other, timeout=0)
            except ray.exceptions.RayActorError as died:
                rank = self._pending.get(ref.hex(), (-1, "?"))[0]
                last_line = (str(error).strip().splitlines() or [""])[-1]
                return other, died, f"(rank {rank} failed too, probably as a consequence: {last_line})"
            except Exception:
                pass
        return ref, error, ""

    def _describe_actor(self, rank: int) -> str:
        info = self._infos[rank] if 0 <= rank < len(self._infos) else None
        if info:
            return f"{self.worker_cls.__name__} actor {info['actor_id']} (pid {info['pid']} on {info['node_ip']})"
        if 0 <= rank < len(self._actors):
            return f"{self.worker_cls.__name__} actor {self._actors[rank]._actor_id.hex()} (not started)"
        return f"{self.worker_cls.__name__} actor (unknown)"

    def _log_tail(self, rank: int, idle: bool) -> str:
        """The last lines rank `rank` wrote: its Ray log files, else (if it is idle) the lines it keeps in memory.

        A rank that hangs is still busy with the call that hangs and would not answer, so only a rank whose call
        raised is asked for its in-memory lines (which also hold the INFO lines ranks > 0 do not print).
        """
        info = self._infos[rank] if 0 <= rank < len(self._infos) else None
        if not info:
            return "(no log: the actor never finished starting)"
        tails = read_log_tail(info.get("log_files", []), info.get("node_id"), LOG_TAIL_LINES, _DIAGNOSE_TIMEOUT_S)
        text = format_log_tail(tails)
        if text or not idle:
            return text or ("(its log files are empty)" if tails else "(its log files could not be read)")
        try:
            lines = ray.get(self._actors[rank].last_log_lines.remote(LOG_TAIL_LINES), timeout=_DIAGNOSE_TIMEOUT_S)
        except Exception:
            return "(its log files could not be read and it does not answer)"
        return f"--- last {len(lines)} logged lines ---\n" + "\n".join(lines) if lines else "(it logged nothing)"

    def _fail_error(self, ref_hex: str, error: Exception, during: str | None, note: str = "") -> None:
        rank, method = self._pending.get(ref_hex, (-1, "?"))
        died = isinstance(error, ray.exceptions.RayActorError)
        what = "died" if died else "raised"
        where = f" during {during}" if during else ""
        headline = (
            f"worker group {self.name!r} rank {rank} ({self._describe_actor(rank)}) {what} in "
            f"{method!r}{where}" + (f" {note}" if note else "")
        )
        self._raise(headline, error, rank, idle=not died, died=died)

    def _fail_timeout(self, pending_hex: list[str], timeout_s: float, during: str | None) -> None:
        ranks = sorted({self._pending.get(h, (-1, "?"))[0] for h in pending_hex})
        method = self._pending.get(pending_hex[0], (-1, "?"))[1]
        rank = ranks[0]
        where = f" during {during}" if during else ""
        headline = (
            f"worker group {self.name!r} rank {rank} ({self._describe_actor(rank)}) did not finish "
            f"{method!r}{where} within {timeout_s:g} s (ranks still running: "
            f"{', '.join(map(str, ranks))}); a rank that never returns is usually blocked in a collective "
            f"that another rank did not join, or was never scheduled (not enough free resources)"
        )
        self._raise(headline, None, rank, idle=False)

    def _raise(self, headline: str, error: Exception | None, rank: int, idle: bool, died: bool = False) -> None:
        tail = self._log_tail(rank, idle)
        actor = self._describe_actor(rank)
        self.shutdown()
        message = headline + (f":\n{error}" if error is not None else "") + f"\n{tail}\nThe group was shut down."
        raise WorkerGroupError(message, group=self.name, rank=rank, actor=actor, log_tail=tail, died=died) from error
