"""Users' code run with a time limit: an environment's steps, a reward function's batches.

Python cannot stop a thread, so a call that never returns (a tool server that hangs, a reward function stuck on a
lock) is left to its thread, and the caller gets `Late` after its limit instead of hanging the run with it.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any


class Late(Exception):
    """A call that did not return within its limit (distinct from a TimeoutError the call itself raises)."""


class CallThread:
    """Calls on one daemon thread, each waited for at most `timeout_s`. One thread, not one per call, so that user
    code may keep thread-bound objects (a sqlite connection made in `__init__`, used in `step`) from call to call.
    A late call's thread is left to it (daemon: it cannot keep the process alive) and the next call gets a new one."""

    def __init__(self, name: str):
        self.name = name
        self._lock = threading.Lock()
        self._calls: queue.SimpleQueue | None = None

    def run(self, fn: Callable[[], Any], timeout_s: float | None) -> Any:
        """`fn()`'s value or exception; `Late` when it has not returned after `timeout_s` (None: no limit)."""
        with self._lock:
            if self._calls is None:
                self._calls = queue.SimpleQueue()
                threading.Thread(target=self._serve, args=(self._calls,), name=self.name, daemon=True).start()
            calls = self._calls
        done: Future = Future()
        calls.put((fn, done))
        try:
            return done.result(timeout=timeout_s)
        except FutureTimeout:
            with self._lock:
                if self._calls is calls:
                    self._calls = None
            raise Late(f"no return within {timeout_s:g} s") from None

    @staticmethod
    def _serve(calls: queue.SimpleQueue) -> None:
        while True:
            fn, done = calls.get()
            try:
                done.set_result(fn())
            except BaseException as err:  # handed to the waiting caller, which raises it
                done.set_exception(err)
