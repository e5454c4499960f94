"""An OpenAI-compatible endpoint over the rollout engines, for agents that speak the OpenAI API, recording every
token it serves (the rows are built from the records: `openppo.agents.transcript`).

Served on 127.0.0.1 by default (FastAPI on uvicorn, in a thread of the driver), non-streaming:
- `POST /v1/chat/completions`: `messages` (and `tools`, handed to the chat template) rendered by the policy's chat
  template; `max_tokens` or `max_completion_tokens`, `temperature`, `top_p`; `n` 1;
- `POST /v1/completions`: `prompt` as text (tokenized without special tokens) or token ids;
- `GET /v1/models`: the one model served.
Every completion request names its episode, by the `X-Session-Id` header or else the OpenAI `user` field; the
server records the call in that session's `Transcript`. A request for another model gets a 404, `stream: true` or
`n` > 1 a 400, a request without a session a 400, each with OpenAI's error shape ({"error": {"message", "type",
"code"}}), so an `openai` client raises with the message. The server takes no files or code from requests.

Concurrent requests are batched (`Batcher`): what arrives within a few milliseconds goes to the engines as one
generate call per distinct sampling setting, as the rollout's own batches do.
"""

from __future__ import annotations

import json
import logging
import queue
import socket
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request, Response
from starlette.concurrency import run_in_threadpool

from openppo.agents.transcript import Call, Transcript

logger = logging.getLogger(__name__)

SESSION_HEADER = "X-Session-Id"


@dataclass(frozen=True)
class Generated:
    token_ids: list[int]
    log_probs: list[float]
    finish_reason: str  # "stop" or "length"
    version: int  # the weights version that generated it (the oldest, should a sync land mid-response)


# (prompt ids of each request, the sampling settings they share) -> one result per prompt
GenerateBatch = Callable[[list[list[int]], dict[str, Any]], list[Generated]]


class Batcher:
    """Gathers concurrent requests for `window_s` after the first and generates them in one call per sampling
    setting, on one thread; `submit` blocks until its own result is back (or raises what the call raised)."""

    def __init__(self, generate: GenerateBatch, window_s: float = 0.005):
        self.generate, self.window_s = generate, window_s
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="endpoint-batcher", daemon=True)
        self._stopped = False
        self._thread.start()

    def submit(self, prompt_ids: list[int], sampling: dict[str, Any], timeout_s: float) -> Generated:
        future: Future = Future()
        self._queue.put((prompt_ids, sampling, future))
        return future.result(timeout=timeout_s)

    def stop(self) -> None:
        self._stopped = True
        self._queue.put(None)
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stopped:
            first = self._queue.get()
            if first is None:
                return
            items, deadline = [first], time.monotonic() + self.window_s
            while (left := deadline - time.monotonic()) > 0:
                try:
                    item = self._queue.get(timeout=left)
                except queue.Empty:
                    break
                if item is None:
                    self._stopped = True
                    break
                items.append(item)
            groups: dict[str, list] = {}
            for item in items:
                groups.setdefault(json.dumps(item[1], sort_keys=True), []).append(item)
            for group in groups.values():
                try:
                    results = self.generate([ids for ids, _, _ in group], group[0][1])
                except Exception as exc:  # every waiting request gets the error
                    for _, _, future in group:
                        future.set_exception(exc)
                    continue
                for (_, _, future), result in zip(group, results):
                    future.set_result(result)


class Sessions:
    """The transcripts of the episodes being played, by session id (thread-safe)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._transcripts: dict[str, Transcript] = {}

    def record(self, session: str, call: Call) -> None:
        with self._lock:
            self._transcripts.setdefault(session, Transcript()).add(call)

    def close(self, session: str) -> Transcript:
        """The session's transcript (empty if it made no call); the session is forgotten."""
        with self._lock:
            return self._transcripts.pop(session, Transcript())


class EndpointError(Exception):
    def __init__(self, status: int, message: str, code: str, param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


def _sampling(body: dict[str, Any], max_tokens_limit: int) -> dict[str, Any]:
    if body.get("stream"):
        raise EndpointError(
            400, "streaming is not supported by this endpoint: send stream=false", "unsupported", "stream"
        )
    if body.get("n", 1) != 1:
        raise EndpointError(400, "n must be 1 (one completion per request)", "unsupported", "n")
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or max_tokens_limit
    return {
        "max_new_tokens": min(int(max_tokens), max_tokens_limit),
        # an explicit null means the default, as in OpenAI's API
        **{key: 1.0 if body.get(key) is None else float(body[key]) for key in ("temperature", "top_p")},
    }


def create_app(
    batcher: Batcher,
    tokenizer,
    sessions: Sessions,
    *,
    model_name: str,
    max_tokens_limit: int,
    timeout_s: float = 600.0,
):
    """The FastAPI app: completions from `batcher`, rendered and decoded with `tokenizer`, recorded in `sessions`."""
    app = FastAPI(title="openppo agent endpoint", docs_url=None, redoc_url=None, openapi_url=None)

    def reply(data: Any, status: int = 200) -> Response:
        return Response(content=json.dumps(data), status_code=status, media_type="application/json")

    def error(exc: EndpointError) -> Response:
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        body = {"error": {"message": str(exc), "type": kind, "code": exc.code, "param": exc.param}}
        return reply(body, exc.status)

    async def parse(request: Request) -> tuple[dict, str]:
        try:
            body = json.loads(await request.body())
        except ValueError as exc:
            raise EndpointError(400, f"the body is not JSON: {exc}", "invalid_json") from exc
        if not isinstance(body, dict):
            raise EndpointError(400, "the body must be a JSON object", "invalid_json")
        if body.get("model") != model_name:
            raise EndpointError(
                404,
                f"model {body.get('model')!r} is not served here; this endpoint serves {model_name!r}",
                "model_not_found",
                "model",
            )
        session = request.headers.get(SESSION_HEADER) or body.get("user")
        if not session:
            raise EndpointError(
                400,
                f"no session: name the episode in the {SESSION_HEADER} header or the 'user' field",
                "missing_session",
                "user",
            )
        return body, str(session)

    def complete(session: str, prompt_ids: list[int], sampling: dict) -> tuple[Generated, str]:
        try:
            out = batcher.submit(prompt_ids, sampling, timeout_s)
        except Exception as exc:  # the engines' error, for the client to see; the server goes on
            logger.warning("agent endpoint: a generation for session %s failed: %s", session, exc)
            raise EndpointError(500, f"generation failed: {exc}", "generation_failed") from exc
        sessions.record(session, Call(prompt_ids, out.token_ids, out.log_probs, out.version, out.finish_reason))
        return out, tokenizer.decode(out.token_ids, skip_special_tokens=True)

    def completion(kind: str, choice: dict[str, Any], prompt_ids: Sequence[int], out: Generated) -> Response:
        """OpenAI's response around one choice: `kind` "chat.completion" or "text_completion"."""
        n, m = len(prompt_ids), len(out.token_ids)
        prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
        choice = {"index": 0, **choice, "finish_reason": out.finish_reason, "logprobs": None}
        return reply(
            {
                "id": f"{prefix}-{uuid.uuid4().hex}",
                "object": kind,
                "created": int(time.time()),
                "model": model_name,
                "choices": [choice],
                "usage": {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m},
            }
        )

    @app.get("/v1/models")
    async def models():
        return reply({"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "openppo"}]})

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        try:
            body, session = await parse(request)
            sampling = _sampling(body, max_tokens_limit)
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                raise EndpointError(400, "'messages' must be a non-empty list", "invalid_messages", "messages")
            try:
                text = tokenizer.apply_chat_template(
                    messages, tools=body.get("tools"), add_generation_prompt=True, tokenize=False
                )
            except Exception as exc:  # the template's own complaint (a role it does not know, ...)
                raise EndpointError(
                    400, f"the chat template cannot render the messages: {exc}", "bad_messages"
                ) from exc
            prompt_ids = tokenizer.encode(text, add_special_tokens=False)
            out, content = await run_in_threadpool(complete, session, prompt_ids, sampling)
        except EndpointError as exc:
            return error(exc)
        return completion("chat.completion", {"message": {"role": "assistant", "content": content}}, prompt_ids, out)

    @app.post("/v1/completions")
    async def completions(request: Request):
        try:
            body, session = await parse(request)
            sampling = _sampling(body, max_tokens_limit)
            prompt = body.get("prompt")
            if isinstance(prompt, str):
                prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
            elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                prompt_ids = list(prompt)
                outside = next((t for t in prompt_ids if not 0 <= t < len(tokenizer)), None)
                if outside is not None:
                    raise EndpointError(
                        400,
                        f"token id {outside} is outside the vocabulary (0..{len(tokenizer) - 1})",
                        "invalid_prompt",
                        "prompt",
                    )
            else:
                raise EndpointError(400, "'prompt' must be a string or a list of token ids", "invalid_prompt", "prompt")
            out, text = await run_in_threadpool(complete, session, prompt_ids, sampling)
        except EndpointError as exc:
            return error(exc)
        return completion("text_completion", {"text": text}, prompt_ids, out)

    return app


class EndpointServer:
    """`app` served by uvicorn on a thread, on `host` and a port the OS picks; `base_url` ends in /v1."""

    def __init__(self, app, host: str = "127.0.0.1", start_timeout_s: float = 30.0):
        import uvicorn

        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, 0))
        host, port = self._sock.getsockname()[:2]
        self.base_url = f"http://{host}:{port}/v1"
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, name="agent-endpoint", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"the agent endpoint did not start within {start_timeout_s:g} s")
            time.sleep(0.01)

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()
