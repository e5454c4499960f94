"""The OpenAI-compatible agent endpoint (openppo/agents/endpoint.py) over a real vLLM engine of the tiny model, used
by the `openai` package as an agent would: every token it trains on is one the engine generated, with the engine's
log-prob (checked against an independent HF forward), template and environment tokens masked; its errors reach the
client in OpenAI's shape; 32 sessions at once are batched into few engine calls."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from openppo.agents.endpoint import Batcher, EndpointServer, Generated, Sessions, create_app
from tests.engines import tiny_engine_actor
from tests.model_cache import tiny_model_dir

pytestmark = pytest.mark.slow
MODEL = "tiny-policy"
VERSION = 7  # the weights version the stand-in pool reports for every generation


@pytest.fixture(scope="module")
def served():
    """(base_url, sessions, engine calls made) of an endpoint over one engine actor."""
    import ray
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir())
    calls = []
    with tiny_engine_actor() as engine:

        def generate(prompts: list[list[int]], sampling: dict) -> list[Generated]:
            calls.append(len(prompts))
            out = ray.get(engine.generate.remote(prompts, n=1, **sampling), timeout=120)
            return [Generated(c["token_ids"], c["logprobs"], c["finish_reason"], VERSION) for (c,) in out]

        batcher = Batcher(generate)
        sessions = Sessions()
        server = EndpointServer(
            create_app(batcher, tok, sessions, model_name=MODEL, max_tokens_limit=16, weight_version=lambda: VERSION)
        )
        try:
            yield server.base_url, sessions, calls
        finally:
            server.stop()
            batcher.stop()


@pytest.fixture(scope="module")
def hf_model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir(), dtype=torch.float32).eval()


def _client(base_url):
    from openai import OpenAI

    return OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


def _agent(base_url: str, session: str, task: str) -> str:
    """A two-turn agent written against the openai package only: it asks, then answers with a tool's result."""
    client = _client(base_url)
    messages = [{"role": "user", "content": task}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, user=session)
    messages += [{"role": "assistant", "content": first.choices[0].message.content}]
    messages += [{"role": "user", "content": "calculator: 5"}]
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, user=session)
    return second.choices[0].message.content


def test_every_trained_token_is_the_engines_with_its_log_prob(served, hf_model):
    base_url, sessions, _ = served
    _agent(base_url, "episode-1", "What is 2 + 3?")
    transcript = sessions.close("episode-1")
    segments = transcript.segments
    # two calls: one row, or two when the template's rendering of the first answer is not the ids sampled
    assert len(segments) == 1 + transcript.sealed and transcript.sealed <= 1
    assert sum(segment.action_mask.count(1) for segment in segments) > 0
    for segment in segments:
        tokens = segment.prompt_ids + segment.response_ids
        with torch.no_grad():
            logits = hf_model(torch.tensor([tokens])).logits[0, len(segment.prompt_ids) - 1 : -1]
        expected = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(segment.response_ids)[:, None])[:, 0]
        trained = torch.tensor(segment.action_mask, dtype=torch.bool)
        recorded = torch.tensor(segment.log_probs)
        assert (recorded[trained] - expected[trained]).abs().max() < 1e-4
        assert (recorded[~trained] == 0).all()
    if transcript.sealed == 0:  # the second prompt extended the first: the tool's text is in the row, masked
        masked = [t for t, m in zip(segments[0].response_ids, segments[0].action_mask) if not m]
        from transformers import AutoTokenizer

        assert "calculator: 5" in AutoTokenizer.from_pretrained(tiny_model_dir()).decode(masked)


def test_completions_take_text_or_token_ids(served):
    base_url, sessions, _ = served
    client = _client(base_url)
    headers = {"X-Session-Id": "episode-2"}
    text = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=4, extra_headers=headers)
    ids = client.completions.create(model=MODEL, prompt=[785, 1284, 374], max_tokens=4, extra_headers=headers)
    assert text.usage.completion_tokens >= 1 and ids.usage.prompt_tokens == 3
    # the reply names the weights that generated it, as the call's record does
    assert text.system_fingerprint == ids.system_fingerprint == f"openppo-weights-v{VERSION}"
    transcript = sessions.close("episode-2")
    assert transcript.segments[-1].prompt_ids == [785, 1284, 374]
    assert set(transcript.segments[-1].versions) == {VERSION}


def test_errors_reach_the_client_in_openai_shape(served):
    import openai

    base_url, _, _ = served
    client = _client(base_url)
    chat = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.NotFoundError, match="model 'gpt-4o' is not served here; this endpoint serves"):
        client.chat.completions.create(model="gpt-4o", messages=chat, user="s")
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        client.chat.completions.create(model=MODEL, messages=chat, user="s", n=2)
    with pytest.raises(openai.BadRequestError, match="no session: name the episode in the path"):
        client.chat.completions.create(model=MODEL, messages=chat)
    with pytest.raises(openai.BadRequestError, match="token id 9000 is outside the vocabulary"):
        client.completions.create(model=MODEL, prompt=[1, 9000], extra_headers={"X-Session-Id": "s"})
    assert [(m.id, m.weight_version) for m in client.models.list().data] == [(MODEL, VERSION)]


def test_a_session_named_by_the_path_ends_when_collected(served):
    """The base URL a run hands each episode's agent names the session: an unmodified client needs nothing else.
    Once the episode is collected, a late call in it is refused (409), not recorded."""
    import openai

    base_url, sessions, _ = served
    client = _client(base_url.removesuffix("/v1") + "/sessions/episode-9/v1")
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert sessions.close("episode-9").calls == 1
    with pytest.raises(openai.ConflictError, match="session episode-9 has ended"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert sessions.close("episode-9").calls == 0


def test_an_anthropic_sdk_agent_is_served_and_recorded(served, hf_model, caplog):
    """An agent written against the `anthropic` package, its base URL the session's (the SDK appends /v1/messages):
    the system prompt, its tool call and the tool's result are rendered by the chat template, the replies come back
    as Anthropic Messages, and both calls land in the session's transcript with the engine's log-probs; errors come
    in Anthropic's shape, which the SDK raises."""
    import anthropic
    from transformers import AutoTokenizer

    base_url, sessions, _ = served
    client = anthropic.Anthropic(
        base_url=base_url.removesuffix("/v1") + "/sessions/claude-1", api_key="unused", max_retries=0, timeout=120
    )
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    first = client.messages.create(model=MODEL, system="Be brief.", messages=messages, max_tokens=6)
    assert first.type == "message" and first.role == "assistant" and first.model == MODEL
    assert first.stop_reason in ("end_turn", "max_tokens") and first.content[0].type == "text"
    messages += [
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": first.content[0].text},
                {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 2, "b": 3}},
            ],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sum: 5"}]},
    ]
    with caplog.at_level(logging.INFO, logger="openppo.agents.endpoint"):
        second = client.messages.create(
            model=MODEL, system="Be brief.", messages=messages, max_tokens=6, stop_sequences=["\n\n"]
        )
    assert "a request asked for stop sequences, which are not applied" in caplog.text
    transcript = sessions.close("claude-1")
    assert transcript.calls == 2
    last = transcript.last
    assert second.usage.input_tokens == len(last.prompt_ids) and second.usage.output_tokens == len(last.output_ids)
    # the SDK's token count of the same request: the rendered prompt's (nothing generated, nothing recorded)
    counted = client.messages.count_tokens(model=MODEL, system="Be brief.", messages=messages)
    assert counted.input_tokens == len(last.prompt_ids) and transcript.calls == 2
    rendered = AutoTokenizer.from_pretrained(tiny_model_dir()).decode(last.prompt_ids)
    assert "Be brief." in rendered and "What is 2 + 3?" in rendered and "sum: 5" in rendered, rendered
    assert '"a": 2' in rendered and "add" in rendered, rendered  # the tool call, as the template renders one
    # the reply is the engine's tokens with the engine's log-probs (against an independent HF forward)
    ids = torch.tensor([list(last.prompt_ids) + list(last.output_ids)])
    with torch.no_grad():
        logits = hf_model(ids).logits[0, len(last.prompt_ids) - 1 : -1]
    expected = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(last.output_ids)[:, None])[:, 0]
    assert (expected - torch.tensor(last.log_probs)).abs().max() < 1e-4
    with pytest.raises(anthropic.NotFoundError, match="model 'claude-x' is not served here"):
        client.messages.create(model="claude-x", messages=messages, max_tokens=4)
    with pytest.raises(anthropic.BadRequestError, match="image blocks are not served"):
        image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
        client.messages.create(model=MODEL, messages=[{"role": "user", "content": [image]}], max_tokens=4)
    with pytest.raises(anthropic.ConflictError, match="session claude-1 has ended"):
        client.messages.create(model=MODEL, messages=messages, max_tokens=4)


def test_streamed_replies_are_the_recorded_ones(served):
    """`stream: true`, as agent CLIs always send it: the chunks the `openai` and `anthropic` clients assemble hold the
    reply the session recorded (text, finish reason, usage), for chat, text completions and Anthropic's Messages."""
    import anthropic
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir())
    base_url, sessions, _ = served
    client = _client(base_url.removesuffix("/v1") + "/sessions/stream-1/v1")
    chat = [{"role": "user", "content": "Count to three."}]
    stream = client.chat.completions.create(
        model=MODEL, messages=chat, max_tokens=6, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    [finish] = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    last = sessions.close("stream-1").last
    assert text == tok.decode(last.output_ids, skip_special_tokens=True)
    assert finish == last.finish_reason and chunks[-1].usage.completion_tokens == len(last.output_ids)
    assert chunks[0].system_fingerprint == f"openppo-weights-v{VERSION}"

    client = _client(base_url.removesuffix("/v1") + "/sessions/stream-2/v1")
    pieces = list(client.completions.create(model=MODEL, prompt="The sky is", max_tokens=4, stream=True))
    last = sessions.close("stream-2").last
    assert "".join(p.choices[0].text for p in pieces) == tok.decode(last.output_ids, skip_special_tokens=True)

    claude = anthropic.Anthropic(
        base_url=base_url.removesuffix("/v1") + "/sessions/stream-3", api_key="unused", max_retries=0, timeout=120
    )
    with claude.messages.stream(model=MODEL, messages=chat, max_tokens=6) as events:
        streamed = "".join(events.text_stream)
        message = events.get_final_message()
    last = sessions.close("stream-3").last
    assert streamed == message.content[0].text == tok.decode(last.output_ids, skip_special_tokens=True)
    assert message.usage.output_tokens == len(last.output_ids) and message.usage.input_tokens == len(last.prompt_ids)
    assert message.stop_reason == ("max_tokens" if last.finish_reason == "length" else "end_turn")


def test_a_responses_api_agent_is_served_and_recorded(served):
    """The `openai` package's Responses client (the OpenAI Agents SDK's default API): instructions, a function call
    and its output rendered by the chat template; the reply's output_text and usage are the recorded call's,
    streamed or not; a previous_response_id is refused (the endpoint keeps no responses)."""
    import openai
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir())
    base_url, sessions, _ = served
    client = _client(base_url.removesuffix("/v1") + "/sessions/responses-1/v1")
    items = [
        {"role": "user", "content": "What is 2 + 3?"},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 2, "b": 3}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sum: 5"},
    ]
    response = client.responses.create(model=MODEL, instructions="Be brief.", input=items, max_output_tokens=6)
    last = sessions.close("responses-1").last
    assert response.output_text == tok.decode(last.output_ids, skip_special_tokens=True)
    assert response.usage.input_tokens == len(last.prompt_ids) and response.usage.output_tokens == len(last.output_ids)
    assert response.status == ("incomplete" if last.finish_reason == "length" else "completed")
    rendered = tok.decode(last.prompt_ids)
    assert "Be brief." in rendered and "sum: 5" in rendered and '"a": 2' in rendered, rendered

    client = _client(base_url.removesuffix("/v1") + "/sessions/responses-2/v1")
    with client.responses.stream(model=MODEL, input="Count to three.", max_output_tokens=6) as stream:
        events = list(stream)  # (the SDK's accumulator checks their order and identities)
    last = sessions.close("responses-2").last
    final = events[-1].response
    assert events[-1].type == f"response.{final.status}"  # incomplete when the reply hit max_output_tokens
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text == tok.decode(last.output_ids, skip_special_tokens=True)
    assert final.status == ("incomplete" if last.finish_reason == "length" else "completed")
    with pytest.raises(openai.BadRequestError, match="keeps no responses"):
        client.responses.create(model=MODEL, input="hi", previous_response_id=final.id)


def test_32_sessions_at_once_are_batched(served):
    base_url, sessions, calls = served
    before = len(calls)
    start = threading.Barrier(32)

    def episode(i: int) -> None:
        start.wait(timeout=60)
        _agent(base_url, f"concurrent-{i}", f"What is {i} + 1?")

    with ThreadPoolExecutor(32) as pool:
        list(pool.map(episode, range(32)))
    transcripts = [sessions.close(f"concurrent-{i}") for i in range(32)]
    assert all(sum(len(s.versions) for s in t.segments) > 0 for t in transcripts)
    made = len(calls) - before
    assert sum(calls[before:]) == 64 and made < 64, calls[before:]  # 64 requests in fewer engine calls


MOLT_CHAT_AGENT = '''
import json

from openai import AsyncOpenAI

from molt.agents import ChatAgent, ChatAgentRunner, Result

SEEN, ANSWERS = [], []


class Calculator(ChatAgent):
    """Asks, answers with a tool's result, asks again; its reward is the second answer's length over 100."""

    async def run(self, ctx):
        SEEN.append(ctx)
        client = AsyncOpenAI(base_url=ctx.base_url, api_key=ctx.api_key, max_retries=0, timeout=120)
        messages = list(ctx.messages)
        budget = ctx.sampling_params.max_tokens
        first = await client.chat.completions.create(model=ctx.model_name, messages=messages, max_tokens=budget)
        messages += [{"role": "assistant", "content": first.choices[0].message.content}]
        messages += [{"role": "user", "content": "calculator: " + json.dumps(ctx.label)}]
        second = await client.chat.completions.create(model=ctx.model_name, messages=messages, max_tokens=budget)
        ANSWERS.append(second.choices[0].message.content)
        return Result(reward=len(ANSWERS[-1]) / 100, info={"turns": 2})


class AgentRunner(ChatAgentRunner):
    def __init__(self):
        super().__init__(Calculator)
'''


def test_a_molt_chat_agent_plays_an_episode_through_the_endpoint(served, tmp_path):
    """A Molt file with `AgentRunner(ChatAgentRunner)` (given as --train.agent_path) runs unchanged as an agent
    program: its ChatAgent gets the data set's prompt as unrendered messages, the session's base URL, the served
    model's name and the run's max_tokens; every call it makes lands in the episode's transcript; the Result's
    reward is the episode's."""
    from transformers import AutoTokenizer

    from openppo.agents import load_agent, load_agent_env
    from openppo.agents.molt import ChatSettings, chat_program
    from openppo.errors import UserError

    path = tmp_path / "chat_agent.py"
    path.write_text(MOLT_CHAT_AGENT)
    runner = load_agent(path, "--train.agent_path")
    with pytest.raises(UserError, match="holds a Molt ChatAgentRunner, played through the run's endpoint"):
        load_agent_env(path, "--train.agent_path")
    settings = ChatSettings(model_name=MODEL, max_tokens=6, temperature=1.0, top_p=1.0, top_k=-1, max_length=64)
    program = chat_program(runner, str(path), settings)
    base_url, sessions, _ = served
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    task = {"prompt": "(rendered)", "messages": messages, "tools": None, "label": 5, "index": 0, "sample": 0}
    task["session"] = "molt-1"
    outcome = program.run(base_url.removesuffix("/v1") + "/sessions/molt-1/v1", task, timeout_s=120)
    assert outcome.error is None, outcome.error
    module = runner.agent_cls.run.__globals__  # (the file's, as the runner's class saw it)
    (ctx,), (answer,) = module["SEEN"], module["ANSWERS"]
    assert ctx.messages == messages and ctx.prompt == "What is 2 + 3?" and ctx.label == 5
    assert ctx.base_url.endswith("/sessions/molt-1/v1") and ctx.session_url == ctx.base_url.removesuffix("/v1")
    assert ctx.model_name == MODEL and ctx.sampling_params.max_tokens == 6 and ctx.max_length == 64
    assert outcome.reward == pytest.approx(len(answer) / 100) and outcome.extra == {"turns": 2.0}
    transcript = sessions.close("molt-1")
    assert transcript.calls == 2 and len(transcript.last.output_ids) <= 6
    # the endpoint rendered the unrendered messages with the chat template, the system turn and the tool's too
    rendered = AutoTokenizer.from_pretrained(tiny_model_dir()).decode(transcript.last.prompt_ids)
    assert "Be brief." in rendered and "What is 2 + 3?" in rendered and "calculator: 5" in rendered
    bad = tmp_path / "bad_agent.py"
    bad.write_text(MOLT_CHAT_AGENT.replace("return Result(reward=", "return (").replace(", info={", ", {"))
    failed = chat_program(load_agent(bad, "--train.agent_path"), str(bad), settings).run(
        base_url.removesuffix("/v1") + "/sessions/molt-2/v1", {**task, "session": "molt-2"}, timeout_s=120
    )
    assert "Calculator.run returned tuple; return a Result" in failed.error
    sessions.close("molt-2")
