"""An OpenAI-compatible endpoint over the rollout engines, for agents that speak the OpenAI API, recording every
token it serves (the rows are built from the records: `openppo.agents.transcript`).

Served on 127.0.0.1 by default (FastAPI on uvicorn, in a thread of the driver):
- `POST /v1/chat/completions`: `messages` (and `tools`, handed to the chat template) rendered by the policy's chat
  template; `max_tokens` or `max_completion_tokens`, `temperature`, `top_p`; `n` 1;
- `POST /v1/completions`: `prompt` as text (tokenized without special tokens) or token ids;
- `POST /v1/responses`: OpenAI's Responses API (`responses_wire`; the OpenAI Agents SDK's default), stateless;
- `POST /v1/messages`: Anthropic's Messages API (`anthropic_wire`: translated to and from the chat route's shapes),
  for agents written against the Anthropic SDK (its base URL: the session's, without `/v1`), and its
  `/v1/messages/count_tokens`;
- `GET /v1/models`: the one model served, with `weight_version`, the weights the engines hold now (SGLang's name
  for it): the version a reply's `system_fingerprint` names, so an agent can tell the policy moved mid-episode.
Every completion request names its episode: by its path (`/sessions/<id>/v1/...`: the base URL a training run
hands each episode's agent, so an unmodified OpenAI client needs nothing else), else the `X-Session-Id` header, else
the OpenAI `user` field; the server records the call in that session's `Transcript`, and a session that has ended
(its episode was collected, or ran out of time) gets a 409. A request for another model gets a 404, `n` > 1 a 400, a
request without a session a 400, each with OpenAI's error shape ({"error": {"message", "type", "code"}}), so an
`openai` client raises with the message. The server takes no files or code from requests.

`stream: true` is served as server-sent events once the reply is generated (`stream_chunks`: its text in one chunk,
the finish reason in the next, the usage last with `stream_options.include_usage`): the engines generate a batch
whole, and agents that always stream (CLIs built on the SDKs) then work unchanged.

In a training run the run's sampling settings (--temperature, --top_p, --top_k) apply to every request: the trainer
recomputes the sampled tokens' log-probs under them, so a request's own temperature or top_p is ignored (logged once).
With a tool parser (vLLM's, for the model family) a chat reply's tool calls come back as OpenAI `tool_calls`, with
finish reason "tool_calls".

Concurrent requests are batched (`Batcher`): what arrives together goes to the engines as one generate call per
distinct sampling setting, as the rollout's own batches do.
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
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from openppo.agents import anthropic_wire, responses_wire
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
    """Gathers concurrent requests and generates them in one call per sampling setting, on one thread; `submit`
    blocks until its own result is back (or raises what the call raised).

    A batch closes when it holds a request of every session that can send one (`expected()`, when given: the
    episodes being played), or once no request has arrived for `gap_s`, or `max_wait_s` after its first. The agents
    of a round send their calls close together but not at once (each builds its client and renders its messages
    first), and a batch cut a few milliseconds after its first request went out nearly alone, making the rest wait
    a whole generation (measured: 32 sessions' first calls went out as 1 + 31 or 7 + 25; bench/agent_endpoint.py)."""

    def __init__(
        self,
        generate: GenerateBatch,
        gap_s: float = 0.2,
        max_wait_s: float = 1.0,
        expected: Callable[[], int] | None = None,
    ):
        self.generate, self.gap_s, self.max_wait_s, self.expected = generate, gap_s, max_wait_s, expected
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
            items, deadline = [first], time.monotonic() + self.max_wait_s
            while (left := deadline - time.monotonic()) > 0 and (self.expected is None or len(items) < self.expected()):
                try:
                    item = self._queue.get(timeout=min(self.gap_s, left))
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
        self._closed: set[str] = set()

    def check_open(self, session: str) -> None:
        if session in self._closed:
            raise EndpointError(409, f"session {session} has ended: its episode is over", "session_closed")

    def record(self, session: str, call: Call) -> None:
        with self._lock:
            self.check_open(session)  # a late call of an agent whose episode ran out of time is not recorded
            self._transcripts.setdefault(session, Transcript()).add(call)

    def close(self, session: str) -> Transcript:
        """The session's transcript (empty if it made no call); later calls in it are refused."""
        with self._lock:
            self._closed.add(session)
            return self._transcripts.pop(session, Transcript())


class EndpointError(Exception):
    def __init__(self, status: int, message: str, code: str, param: str | None = None):
        super().__init__(message)
        self.status, self.code, self.param = status, code, param


def _sampling(body: dict[str, Any], max_tokens_limit: int, fixed: dict[str, float] | None) -> dict[str, Any]:
    if body.get("n", 1) != 1:
        raise EndpointError(400, "n must be 1 (one completion per request)", "unsupported", "n")
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or max_tokens_limit
    out: dict[str, Any] = {"max_new_tokens": min(int(max_tokens), max_tokens_limit)}
    if fixed is None:
        # an explicit null means the default, as in OpenAI's API
        out.update({key: 1.0 if body.get(key) is None else float(body[key]) for key in ("temperature", "top_p")})
    return out


def stream_chunks(full: dict[str, Any], include_usage: bool) -> list[dict[str, Any]]:
    """A chat or text completion (`completion`'s body) as the chunks of a streamed reply: the reply is generated whole,
    so its text (and tool calls) go in one chunk and the finish reason in the next; with `include_usage`
    (`stream_options`) a last chunk without choices carries the usage, as OpenAI sends it."""
    chat = full["object"] == "chat.completion"
    head = {key: full[key] for key in ("id", "created", "model", "system_fingerprint")}
    head["object"] = "chat.completion.chunk" if chat else "text_completion"
    (choice,) = full["choices"]
    if chat:
        message = choice["message"]
        delta: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
        if message.get("tool_calls"):
            delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
        first, last = {"delta": delta}, {"delta": {}}
    else:
        first, last = {"text": choice["text"]}, {"text": ""}
    chunks = [
        {**head, "choices": [{"index": 0, **first, "logprobs": None, "finish_reason": None}]},
        {**head, "choices": [{"index": 0, **last, "logprobs": None, "finish_reason": choice["finish_reason"]}]},
    ]
    if include_usage:
        chunks.append({**head, "choices": [], "usage": full["usage"]})
    return chunks


def tool_parser_names() -> list[str]:
    """The names of vLLM's tool-call parsers (--agent_tool_parser)."""
    from vllm.tool_parsers import ToolParserManager

    return sorted({*ToolParserManager.tool_parsers, *ToolParserManager.lazy_parsers})


def tool_parser_factory(name: str, tokenizer) -> Callable[[list | None], Any]:
    """`tools -> parser` for vLLM's tool-call parser `name` (a KeyError names the ones it has)."""
    from vllm.tool_parsers import ToolParserManager

    try:
        parser_cls = ToolParserManager.get_tool_parser(name)
    except KeyError:
        raise KeyError(f"vLLM has no tool parser {name!r}; it has: {', '.join(tool_parser_names())}") from None
    quiet = _OneParserError()
    logging.getLogger(parser_cls.__module__).addFilter(quiet)
    return lambda tools: parser_cls(tokenizer, tools)


def assistant_message(text: str, body: dict[str, Any], parser) -> tuple[dict[str, Any], bool]:
    """The reply's message: its text, or with `parser` (made for the request's tools) the text before the tool calls
    and the calls in OpenAI's shape; and whether it called a tool."""
    if parser is None or not body.get("tools"):
        return {"role": "assistant", "content": text}, False
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    info = parser.extract_tool_calls(text, ChatCompletionRequest.model_validate(body))
    if not info.tools_called:
        return {"role": "assistant", "content": text}, False
    calls = [call.model_dump(exclude_none=True) for call in info.tool_calls]
    return {"role": "assistant", "content": info.content, "tool_calls": calls}, True


def template_messages(messages: list) -> list[dict[str, Any]]:
    """The request's messages as chat templates expect them (as vLLM's server passes them): a missing or null
    `content` (an assistant turn that only calls tools) is "", and a tool call's `arguments`, a JSON string in
    OpenAI's API, is the object it encodes, so that a template renders the call as the model wrote it."""
    out = []
    for message in messages:
        if not isinstance(message, dict):
            raise EndpointError(400, "each of 'messages' must be an object", "invalid_messages", "messages")
        message = {**message, "content": "" if message.get("content") is None else message["content"]}
        if message.get("tool_calls"):
            message["tool_calls"] = [_decoded_arguments(call) for call in message["tool_calls"]]
        out.append(message)
    return out


def _decoded_arguments(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call  # left as the text it is
    return {**call, "function": {**function, "arguments": arguments}}


class _OneParserError(logging.Filter):
    """vLLM's tool parsers log every reply whose tool call does not parse with a traceback; the reply goes back as
    text, which is the agent's to handle, so after the first such log each is counted instead."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR:
            return True
        self.count += 1
        if self.count == 1:
            record.msg = f"{record.msg} (the reply goes back as text; later ones are not logged)"
        return self.count == 1


def create_app(
    batcher: Batcher,
    tokenizer,
    sessions: Sessions,
    *,
    model_name: str,
    max_tokens_limit: int,
    timeout_s: float = 600.0,
    sampling: dict[str, float] | None = None,
    max_context: int | None = None,
    tool_parser: Callable[[list | None], Any] | None = None,
    weight_version: Callable[[], int] = lambda: 0,
):
    """The FastAPI app: completions from `batcher`, rendered and decoded with `tokenizer`, recorded in `sessions`.
    `sampling`: the run's settings, which every request gets (module doc); `max_context`: prompt and completion
    tokens at most (the engines' context), a longer prompt is refused; `tool_parser`: `tool_parser_factory`'s;
    `weight_version`: the engines' weights version now."""
    app = FastAPI(title="openppo agent endpoint", docs_url=None, redoc_url=None, openapi_url=None)
    ignored: set[str] = set()  # request settings that the run's override, logged once each

    def reply(data: Any, status: int = 200) -> Response:
        return Response(content=json.dumps(data), status_code=status, media_type="application/json")

    def error(exc: EndpointError) -> Response:
        kind = "invalid_request_error" if exc.status < 500 else "server_error"
        body = {"error": {"message": str(exc), "type": kind, "code": exc.code, "param": exc.param}}
        return reply(body, exc.status)

    async def read(request: Request) -> dict:
        try:
            body = json.loads(await request.body())
        except ValueError as exc:
            raise EndpointError(400, f"the body is not JSON: {exc}", "invalid_json") from exc
        if not isinstance(body, dict):
            raise EndpointError(400, "the body must be a JSON object", "invalid_json")
        return body

    async def read_as(request: Request, wire) -> tuple[dict, dict]:
        """A request in another API's shape (`wire`: `anthropic_wire`, `responses_wire`): its body, and the chat
        request `wire.to_chat_body` makes of it (a 400 when it cannot)."""
        raw = await read(request)
        try:
            return raw, wire.to_chat_body(raw)
        except ValueError as exc:
            raise EndpointError(400, str(exc), "invalid_request") from exc

    def check_model(body: dict) -> None:
        if body.get("model") != model_name:
            raise EndpointError(
                404,
                f"model {body.get('model')!r} is not served here; this endpoint serves {model_name!r}",
                "model_not_found",
                "model",
            )

    def admit(body: dict, request: Request, path_session: str | None) -> tuple[str, dict]:
        """The request's session and sampling settings, once its model and session are checked."""
        check_model(body)
        session = path_session or request.headers.get(SESSION_HEADER) or body.get("user")
        if not session:
            raise EndpointError(
                400,
                f"no session: name the episode in the path (/sessions/<id>/v1), the {SESSION_HEADER} header or "
                f"the 'user' field",
                "missing_session",
                "user",
            )
        sessions.check_open(str(session))
        if body.get("stop") and "stop" not in ignored:
            ignored.add("stop")
            logger.info(
                "agent endpoint: a request asked for stop sequences, which are not applied: replies run to the end "
                "of the turn or max_tokens (logged once)"
            )
        if sampling is not None:
            for key, value in sampling.items():
                if body.get(key) is not None and float(body[key]) != value and key not in ignored:
                    ignored.add(key)
                    logger.info(
                        "agent endpoint: a request asked for %s=%s; the run samples with %s=%s (--%s), which the "
                        "trainer's log-probs assume (logged once)",
                        key,
                        body[key],
                        key,
                        value,
                        key,
                    )
        return str(session), _sampling(body, max_tokens_limit, sampling)

    async def parse(request: Request, path_session: str | None) -> tuple[dict, str, dict]:
        body = await read(request)
        return (body, *admit(body, request, path_session))

    def complete(session: str, prompt_ids: list[int], params: dict) -> Generated:
        if max_context is not None:
            if len(prompt_ids) >= max_context:
                raise EndpointError(
                    400,
                    f"the prompt has {len(prompt_ids)} tokens and leaves no room in the context of {max_context} "
                    f"(--max_len)",
                    "context_length_exceeded",
                    "messages",
                )
            params = {**params, "max_new_tokens": min(params["max_new_tokens"], max_context - len(prompt_ids))}
        try:
            out = batcher.submit(prompt_ids, params, timeout_s)
        except Exception as exc:  # the engines' error, for the client to see; the server goes on
            logger.warning("agent endpoint: a generation for session %s failed: %s", session, exc)
            raise EndpointError(500, f"generation failed: {exc}", "generation_failed") from exc
        sessions.record(session, Call(prompt_ids, out.token_ids, out.log_probs, out.version, out.finish_reason))
        return out

    def completion(
        kind: str, choice: dict[str, Any], prompt_ids: Sequence[int], out: Generated, body: dict
    ) -> Response:
        """OpenAI's response around one choice: `kind` "chat.completion" or "text_completion"; streamed when the
        request asked (`stream_chunks`)."""
        n, m = len(prompt_ids), len(out.token_ids)
        prefix = "chatcmpl" if kind == "chat.completion" else "cmpl"
        choice = {"index": 0, "finish_reason": out.finish_reason, **choice, "logprobs": None}
        full = {
            "id": f"{prefix}-{uuid.uuid4().hex}",
            "object": kind,
            "created": int(time.time()),
            "model": model_name,
            # OpenAI's field for the backend that answered: here the weights version that generated the reply
            "system_fingerprint": f"openppo-weights-v{out.version}",
            "choices": [choice],
            "usage": {"prompt_tokens": n, "completion_tokens": m, "total_tokens": n + m},
        }
        if not body.get("stream"):
            return reply(full)
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        events = [f"data: {json.dumps(chunk)}\n\n" for chunk in stream_chunks(full, usage)] + ["data: [DONE]\n\n"]
        return StreamingResponse(iter(events), media_type="text/event-stream")

    def text_of(out: Generated, keep_special: bool) -> str:
        ids = list(out.token_ids)
        if keep_special and ids and ids[-1] == tokenizer.eos_token_id:
            ids = ids[:-1]  # the end of turn, not text; other special tokens may mark tool calls
        return tokenizer.decode(ids, skip_special_tokens=not keep_special)

    async def models():
        model = {"id": model_name, "object": "model", "owned_by": "openppo", "weight_version": weight_version()}
        return reply({"object": "list", "data": [model]})

    def render(body: dict) -> list[int]:
        """A chat request's prompt ids: its messages (and tools) rendered by the chat template, tokenized."""
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise EndpointError(400, "'messages' must be a non-empty list", "invalid_messages", "messages")
        try:
            text = tokenizer.apply_chat_template(
                template_messages(messages), tools=body.get("tools"), add_generation_prompt=True, tokenize=False
            )
        except Exception as exc:  # the template's own complaint (a role it does not know, ...)
            raise EndpointError(400, f"the chat template cannot render the messages: {exc}", "bad_messages") from exc
        return tokenizer.encode(text, add_special_tokens=False)

    async def chat_reply(body: dict, session: str, params: dict) -> tuple[dict, bool, list[int], Generated]:
        """A chat request's assistant message (and whether it called a tool), its prompt ids and the generation."""
        prompt_ids = render(body)
        out = await run_in_threadpool(complete, session, prompt_ids, params)
        parser = tool_parser(body.get("tools")) if tool_parser is not None and body.get("tools") else None
        message, called = assistant_message(text_of(out, parser is not None), body, parser)
        return message, called, prompt_ids, out

    async def chat(request: Request, session: str | None = None):
        try:
            body, session, params = await parse(request, session)
            message, called, prompt_ids, out = await chat_reply(body, session, params)
        except EndpointError as exc:
            return error(exc)
        choice = {"message": message, **({"finish_reason": "tool_calls"} if called else {})}
        return completion("chat.completion", choice, prompt_ids, out, body)

    async def translated(request: Request, session: str | None, wire, fail: Callable[[EndpointError], Response]):
        """A request in another API's shape served by the chat route: `wire` (`anthropic_wire`, `responses_wire`)
        translates it (`to_chat_body`) and the reply (`to_reply`, or `stream_events` with `stream: true`); `fail`
        answers an error in that API's shape."""
        try:
            raw, body = await read_as(request, wire)
            session, params = admit(body, request, session)
            message, _, prompt_ids, out = await chat_reply(body, session, params)
        except EndpointError as exc:
            return fail(exc)
        answer = wire.to_reply(message, out.finish_reason, len(prompt_ids), len(out.token_ids), raw)
        if not body.get("stream"):
            return reply(answer)
        events = [f"event: {name}\ndata: {json.dumps(data)}\n\n" for name, data in wire.stream_events(answer)]
        return StreamingResponse(iter(events), media_type="text/event-stream")

    def anthropic_error(exc: EndpointError) -> Response:
        return reply(anthropic_wire.error_body(str(exc), exc.status), exc.status)

    async def anthropic_messages(request: Request, session: str | None = None):
        return await translated(request, session, anthropic_wire, anthropic_error)

    async def anthropic_count_tokens(request: Request, session: str | None = None):
        """Anthropic's token count of a Messages request (agent CLIs ask it to manage their context): the prompt the
        chat template renders, counted; nothing is generated or recorded, so no session is needed."""
        try:
            _, body = await read_as(request, anthropic_wire)
            check_model(body)
            prompt_ids = render(body)
        except EndpointError as exc:
            return anthropic_error(exc)
        return reply({"input_tokens": len(prompt_ids)})

    async def responses(request: Request, session: str | None = None):
        return await translated(request, session, responses_wire, error)

    async def completions(request: Request, session: str | None = None):
        try:
            body, session, params = await parse(request, session)
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
            out = await run_in_threadpool(complete, session, prompt_ids, params)
        except EndpointError as exc:
            return error(exc)
        return completion("text_completion", {"text": text_of(out, False)}, prompt_ids, out, body)

    # the same routes under each episode's base URL (/sessions/<id>/v1)
    for prefix in ("/v1", "/sessions/{session}/v1"):
        app.add_api_route(f"{prefix}/models", models, methods=["GET"])
        app.add_api_route(f"{prefix}/chat/completions", chat, methods=["POST"])
        app.add_api_route(f"{prefix}/completions", completions, methods=["POST"])
        app.add_api_route(f"{prefix}/messages", anthropic_messages, methods=["POST"])
        app.add_api_route(f"{prefix}/messages/count_tokens", anthropic_count_tokens, methods=["POST"])
        app.add_api_route(f"{prefix}/responses", responses, methods=["POST"])
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
