"""An HTTP front for any `RewardSource` (FastAPI on uvicorn); the JSON contract is in `openppo.rewards.remote`.

Endpoints: POST /get_reward, GET /health (status, source and request counters). A malformed request gets a 400
with {"error": ...}, an oversized one (too many samples or bytes) a 413, a failing reward source a 500; none of
them stops the server. Requests are scored one at a time (a lock around the source: models and user functions
need not be thread-safe) in a worker thread, so /health answers while a batch is being scored.
"""

from __future__ import annotations

import errno
import json
import logging
import socket
import threading
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request, Response
from starlette.concurrency import run_in_threadpool

from openppo.errors import UserError
from openppo.rewards.base import RewardSource

logger = logging.getLogger(__name__)


class BadRequest(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def parse_request(payload: Any, max_samples: int) -> tuple[list[str], list[str], list]:
    """(queries, prompts, labels) of a decoded request body, or BadRequest. Missing prompts/labels: "" / None."""
    if not isinstance(payload, dict):
        raise BadRequest(
            400,
            f"the body must be a JSON object with 'query', 'prompts', 'labels', got a JSON {type(payload).__name__}",
        )
    if "query" not in payload:
        raise BadRequest(400, f"missing 'query' (a list of strings); got keys {sorted(payload)}")
    queries = payload["query"]
    if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
        raise BadRequest(400, "'query' must be a list of strings")
    num = len(queries)
    if num > max_samples:
        raise BadRequest(
            413,
            f"{num} samples in one request; the limit is {max_samples} (--max_request_samples): send smaller batches",
        )
    prompts = payload.get("prompts")
    if prompts is None:
        prompts = [""] * num
    elif not isinstance(prompts, list) or not all(isinstance(p, str) for p in prompts):
        raise BadRequest(400, "'prompts' must be a list of strings")
    labels = payload.get("labels")
    if labels is None:
        labels = [None] * num
    elif not isinstance(labels, list):
        raise BadRequest(400, "'labels' must be a list (one JSON value per query)")
    if not (len(prompts) == num == len(labels)):
        raise BadRequest(400, f"lengths disagree: {num} queries, {len(prompts)} prompts, {len(labels)} labels")
    return queries, prompts, labels


def _json(data: Any, status: int = 200):
    # json.dumps rather than JSONResponse: extra_logs may hold NaN, which Python clients read back.
    return Response(content=json.dumps(data), status_code=status, media_type="application/json")


def create_app(source: RewardSource, *, max_request_samples: int = 4096, max_request_bytes: int = 32 * 2**20):
    """The FastAPI app serving `source`."""
    app = FastAPI(title="openppo reward server", docs_url=None, redoc_url=None, openapi_url=None)
    lock = threading.Lock()
    # Counters for /health: how much was scored, refused (4xx) and failed (5xx) since start.
    stats = {"requests": 0, "samples": 0, "rejected": 0, "failed": 0}

    def score_locked(queries, prompts, labels):
        with lock:
            result = source.score(queries, prompts, labels)
            stats["requests"] += 1
            stats["samples"] += len(queries)
            return result

    async def read_body(request: Request) -> bytes:
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_request_bytes:
            raise BadRequest(
                413,
                f"body of {declared} bytes; the limit is {max_request_bytes} "
                f"(--max_request_bytes): send smaller batches",
            )
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_request_bytes:
                raise BadRequest(
                    413, f"body over {max_request_bytes} bytes (--max_request_bytes): send smaller batches"
                )
        return bytes(body)

    @app.post("/get_reward")
    async def get_reward(request: Request):
        try:
            body = await read_body(request)
            try:
                payload = json.loads(body)
            except ValueError as err:
                raise BadRequest(400, f"the body is not JSON: {err}") from err
            queries, prompts, labels = parse_request(payload, max_request_samples)
        except BadRequest as err:
            logger.warning("rejected a request (HTTP %d): %s", err.status, err)
            stats["rejected"] += 1
            return _json({"error": str(err)}, err.status)
        try:
            result = await run_in_threadpool(score_locked, queries, prompts, labels)
        except Exception as err:  # the server keeps serving; the client sees the cause
            logger.exception("scoring %d samples failed", len(queries))
            stats["failed"] += 1
            return _json({"error": f"{type(err).__name__}: {err}"}, 500)
        return _json(result.to_json())

    @app.get("/health")
    async def health():
        return _json({"status": "ok", "source": source.name, **stats})

    return app


def bind(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port); UserError naming --host/--port when that fails."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        fix = (
            "pass an address of this machine as --host (127.0.0.1 = local only)"
            if isinstance(err, socket.gaierror) or err.errno == errno.EADDRNOTAVAIL
            else "pick another --port (0 = any free port)"
        )
        raise UserError(f"--host/--port: cannot listen on {host}:{port} ({err.strerror or err}); {fix}") from err
    return sock


def serve(app, sock: socket.socket, on_ready: Callable[[int], None]) -> None:
    """Run `app` on the bound `sock` until SIGINT/SIGTERM; `on_ready(port)` once connections are accepted."""
    import uvicorn

    class _Server(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            await super().startup(sockets=sockets)
            if not self.should_exit:
                on_ready(sock.getsockname()[1])

    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
    server = _Server(config)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
