"""Rewards from HTTP servers (`--remote_rm_url http://host:5000/get_reward[,http://...]`).

JSON contract (`python -m openppo.cli.serve_rm` implements the server side):

    POST <url>   {"query": [str, ...], "prompts": [str, ...], "labels": [any JSON, ...]}
    200          {"rewards": [float, ...], "scores": [float, ...] (optional), "extra_logs": {name: [float, ...]}
                  (optional)}
    4xx / 5xx    {"error": "..."} (any body is shown in the error message)

A batch is cut into chunks of `batch_size` samples; chunk i goes to url i mod len(urls) and the chunks are sent
concurrently from a thread pool, then merged back in query order.

Remote reward servers are where RL runs hang (a server that accepts the connection and never answers) or fail
far from the cause (a swallowed exception leaving a sample without a reward). Here every request has a timeout,
connection errors, timeouts and 5xx answers are retried a bounded number of times with exponential backoff, a 4xx
answer (a request the server will never accept) is not retried, and when the retries are spent `score` raises
`RewardError` naming the URL, the last status or exception and the number of samples. The worst case before that
error is `worst_case_s` = (max_retries + 1) * timeout_s + backoff_s * (2**max_retries - 1).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

import requests

from openppo.rewards.base import RewardError, RewardResult, RewardSource, check_inputs, dropped_logs, to_result

logger = logging.getLogger(__name__)


class _Unavailable(RewardError):
    """The server stayed unreachable, slow or failing (5xx) through every retry."""


def _body_text(resp: requests.Response, limit: int = 500) -> str:
    try:
        data = resp.json()
        text = data["error"] if isinstance(data, dict) and "error" in data else json.dumps(data)
    except ValueError:
        text = resp.text
    text = str(text).strip()
    return text if len(text) <= limit else text[:limit] + "..."


class RemoteReward(RewardSource):
    """Scores batches by POSTing them to one or more reward servers."""

    def __init__(
        self,
        urls: list[str],
        *,
        timeout_s: float = 60.0,
        max_retries: int = 3,
        backoff_s: float = 1.0,
        batch_size: int = 64,
        default_reward: float | None = None,
        max_concurrency: int | None = None,
    ):
        if not urls:
            raise ValueError("RemoteReward needs at least one URL")
        if timeout_s <= 0 or max_retries < 0 or backoff_s < 0 or batch_size < 1:
            raise ValueError(
                f"RemoteReward: need timeout_s > 0, max_retries >= 0, backoff_s >= 0, batch_size >= 1; "
                f"got {timeout_s}, {max_retries}, {backoff_s}, {batch_size}"
            )
        self.urls = list(urls)
        self.name = "remote reward " + ",".join(self.urls)
        self.timeout_s = float(timeout_s)
        self.max_retries = int(max_retries)
        self.backoff_s = float(backoff_s)
        self.batch_size = int(batch_size)
        self.default_reward = default_reward
        self.num_defaulted = 0
        """samples that got `default_reward` because their server was unavailable (for the trainer to log)"""
        self.max_concurrency = max_concurrency or min(32, 4 * len(self.urls))
        self._executor: ThreadPoolExecutor | None = None
        self._local = threading.local()
        self._sessions: list[requests.Session] = []
        self._lock = threading.Lock()

    @property
    def worst_case_s(self) -> float:
        """Longest a chunk can take before `score` gives up on it (ignoring local scheduling)."""
        return (self.max_retries + 1) * self.timeout_s + self.backoff_s * (2**self.max_retries - 1)

    def score(self, queries: list[str], prompts: list[str], labels: list) -> RewardResult:
        check_inputs(queries, prompts, labels)
        spans = [
            (start, min(start + self.batch_size, len(queries))) for start in range(0, len(queries), self.batch_size)
        ]
        if not spans:
            return RewardResult(rewards=[])
        jobs = [
            (self.urls[i % len(self.urls)], queries[a:b], prompts[a:b], labels[a:b]) for i, (a, b) in enumerate(spans)
        ]
        if len(jobs) == 1:
            parts = [self._score_chunk(*jobs[0])]
        else:
            executor = self._pool()
            futures = [executor.submit(self._score_chunk, *job) for job in jobs]
            done, pending = wait(futures, return_when=FIRST_EXCEPTION)
            for future in pending:
                future.cancel()
            failed = [f for f in futures if f in done and f.exception() is not None]
            if failed:
                raise failed[0].exception()
            parts = [f.result() for f in futures]
        lost = dropped_logs(parts)
        if lost:
            logger.warning(
                "%s: extra_logs %s missing from some chunks; not logged for this batch", self.name, sorted(lost)
            )
        return RewardResult.concat(parts)

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
        with self._lock:
            for session in self._sessions:
                session.close()
            self._sessions.clear()

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="remote-reward")
        return self._executor

    def _session(self) -> requests.Session:
        # requests.Session is not documented as thread-safe: one per thread, each keeping its connections alive.
        session = getattr(self._local, "session", None)
        if session is None:
            session = self._local.session = requests.Session()
            with self._lock:
                self._sessions.append(session)
        return session

    def _score_chunk(self, url: str, queries, prompts, labels) -> RewardResult:
        try:
            return self._post(url, queries, prompts, labels)
        except _Unavailable as err:
            if self.default_reward is None:
                raise
            with self._lock:
                self.num_defaulted += len(queries)
            logger.warning("%s; using default_reward=%s for these %d samples", err, self.default_reward, len(queries))
            return RewardResult(rewards=[float(self.default_reward)] * len(queries))

    def _post(self, url: str, queries, prompts, labels) -> RewardResult:
        num = len(queries)
        try:
            body = json.dumps({"query": list(queries), "prompts": list(prompts), "labels": list(labels)})
        except (TypeError, ValueError) as err:
            raise RewardError(
                f"remote reward {url}: the labels cannot be sent as JSON ({err}); use str/number/list/dict labels"
            ) from err
        attempts = self.max_retries + 1
        start = time.monotonic()
        problem = ""
        for attempt in range(attempts):
            if attempt:
                delay = self.backoff_s * 2 ** (attempt - 1)
                logger.warning(
                    "remote reward %s: attempt %d/%d failed (%s); retrying in %.1f s",
                    url,
                    attempt,
                    attempts,
                    problem,
                    delay,
                )
                time.sleep(delay)
            try:
                resp = self._session().post(
                    url,
                    data=body,
                    headers={"Content-Type": "application/json"},
                    timeout=self.timeout_s,
                    allow_redirects=False,
                )
            except (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError) as err:
                problem = f"{type(err).__name__}: {err}"
                continue
            except requests.RequestException as err:
                raise RewardError(
                    f"remote reward {url}: request for {num} samples failed: {type(err).__name__}: {err}"
                ) from err
            if resp.status_code >= 500:
                problem = f"HTTP {resp.status_code}: {_body_text(resp)}"
                continue
            if resp.status_code != 200:
                raise RewardError(
                    f"remote reward {url} rejected {num} samples with HTTP {resp.status_code} "
                    f"(not retried): {_body_text(resp)}"
                )
            try:
                data = resp.json()
            except ValueError as err:
                raise RewardError(f"remote reward {url}: the answer is not JSON ({err}): {resp.text[:200]!r}") from err
            return to_result(data, num, f"remote reward {url}")
        raise _Unavailable(
            f"remote reward {url} failed for {num} samples after {attempts} attempts in "
            f"{time.monotonic() - start:.1f} s (timeout_s={self.timeout_s:g}): {problem}"
        )
