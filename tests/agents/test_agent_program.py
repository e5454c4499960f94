"""--agent_program's parts that need no engine: loading and running the user's agent (a Python callable or a command)
with its outcome (reward, None, or why the episode is dropped), vLLM's tool-call parser turning a reply into OpenAI
`tool_calls`, and an episode's segments as training rows that share the episode's advantage (hand-computed)."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from openppo.agents.endpoint import assistant_message, tool_parser_factory
from openppo.agents.program import CommandAgent, PythonAgent, load_agent_program
from openppo.errors import UserError
from openppo.ppo.config import AlgoConfig
from openppo.ppo.experience import collate_samples, compute_advantages_for_batch, training_rows
from openppo.rollout.pool import Sample
from tests.model_cache import tiny_model_dir

TASK = {"prompt": "2 + 3", "label": "5", "index": 7, "sample": 1, "session": "s1"}


def test_a_python_agent_gets_the_url_and_task_and_returns_its_reward(tmp_path):
    f = tmp_path / "my_agent.py"
    f.write_text(
        "def agent(base_url, task):\n    return 1.0 if task['label'] == '5' else 0.0\n"
        "def judge_later(base_url, task):\n    return None\n"
        "def broken(base_url, task):\n    raise ValueError('the tool crashed')\n"
        "def wordy(base_url, task):\n    return 'yes'\n"
        "def slow(base_url, task):\n    import time; time.sleep(5)\n"
    )
    assert isinstance(load_agent_program(str(f)), PythonAgent)
    assert load_agent_program(str(f)).run("http://x/v1", TASK, 10).reward == 1.0
    assert load_agent_program(f"{f}:judge_later").run("http://x/v1", TASK, 10).reward is None
    broken = load_agent_program(f"{f}:broken").run("http://x/v1", TASK, 10)
    assert broken.reward is None and "Traceback" in broken.error and "ValueError: the tool crashed" in broken.error
    assert "returned 'yes': return a finite number" in load_agent_program(f"{f}:wordy").run("u", TASK, 10).error
    assert "did not finish within 0.2 s (--agent_timeout)" in load_agent_program(f"{f}:slow").run("u", TASK, 0.2).error


def test_agent_program_errors_name_the_flag(tmp_path):
    with pytest.raises(UserError, match="--agent_program: agent file nowhere.py not found"):
        load_agent_program("nowhere.py")
    f = tmp_path / "a.py"
    f.write_text("x = 1\n")
    with pytest.raises(UserError, match="--agent_program: .*a.py defines no callable 'agent'"):
        load_agent_program(str(f))
    with pytest.raises(UserError, match="defines no callable 'x'"):
        load_agent_program(f"{f}:x")  # a name that is not callable
    assert isinstance(load_agent_program(f"{sys.executable} a.py --fast"), CommandAgent)


def test_a_command_agent_reads_its_environment_and_prints_the_reward(tmp_path):
    script = tmp_path / "cmd_agent.py"
    script.write_text(
        "import json, os, sys\n"
        "task = json.loads(os.environ['OPENPPO_TASK'])\n"
        "print('talking to', os.environ['OPENAI_BASE_URL'])\n"
        "assert os.environ['ANTHROPIC_BASE_URL'] + '/v1' == os.environ['OPENAI_BASE_URL']\n"
        "if task['label'] == 'fail':\n    sys.exit('no luck')\n"
        "print(0.25 if task['label'] == '5' else 'none')\n"
    )
    agent = load_agent_program(f"{sys.executable} {script}")
    assert agent.run("http://127.0.0.1:1/sessions/s1/v1", TASK, 30).reward == 0.25
    url = "http://127.0.0.1:1/sessions/s2/v1"
    assert agent.run(url, {**TASK, "label": "7"}, 30).reward is None
    failed = agent.run(url, {**TASK, "label": "fail"}, 30)
    assert "exited with 1" in failed.error and "no luck" in failed.error
    sleeper = load_agent_program(f"{sys.executable} -c 'import time; time.sleep(30)'")
    assert "did not finish within 0.5 s" in sleeper.run("u", TASK, 0.5).error


def test_a_tool_call_comes_back_in_openai_shape():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir())
    parser = tool_parser_factory("hermes", tok)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    body = {"model": "m", "messages": [{"role": "user", "content": "2 + 3"}], "tools": tools}
    text = 'Let me add.<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    message, called = assistant_message(text, body, parser(tools))
    assert called and message["content"] == "Let me add."
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["id"]
    assert call["function"]["name"] == "add" and json.loads(call["function"]["arguments"]) == {"a": 2, "b": 3}
    assert assistant_message("just text", body, parser(tools)) == ({"role": "assistant", "content": "just text"}, False)
    with pytest.raises(KeyError, match="vLLM has no tool parser 'nope'; it has: .*hermes"):
        tool_parser_factory("nope", tok)


def test_a_streamed_completion_is_two_chunks_and_the_usage():
    from openppo.agents.endpoint import stream_chunks

    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
    message = {"role": "assistant", "content": "Adding.", "tool_calls": [call]}
    head = {"id": "chatcmpl-1", "created": 7, "model": "m", "system_fingerprint": "openppo-weights-v3"}
    usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    choice = {"index": 0, "finish_reason": "tool_calls", "message": message, "logprobs": None}
    full = {**head, "object": "chat.completion", "choices": [choice], "usage": usage}
    first, last, counted = stream_chunks(full, include_usage=True)
    chunk = {**head, "object": "chat.completion.chunk"}
    delta = {"role": "assistant", "content": "Adding.", "tool_calls": [{"index": 0, **call}]}
    assert first == {**chunk, "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]}
    assert last == {**chunk, "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"}]}
    assert counted == {**chunk, "choices": [], "usage": usage}
    text = {**head, "object": "text_completion", "usage": usage}
    text["choices"] = [{"index": 0, "finish_reason": "length", "text": "blue", "logprobs": None}]
    assert [c["choices"][0]["text"] for c in stream_chunks(text, include_usage=False)] == ["blue", ""]


def _row(prompt, response, mask, group):
    return Sample(prompt, response, [-0.5] * len(response), "stop", group, action_mask=mask)


def test_segments_are_rows_that_share_their_episodes_advantage():
    """Two prompts x 2 episodes; episode 1 has two segments (sealed once). GRPO (group_norm): the reward is shaped
    per episode, A = (r - mean) / (std + eps) over the prompt's 2 episodes, and every generated token of every segment
    of an episode carries its A; template tokens (mask 0) none. 5 rows padded to 6 for 2 data-parallel ranks."""
    episodes = [
        Sample([1, 2], [3, 4], [-0.5] * 2, "stop", 0),
        Sample([1, 2], [], [], "stop", 0, segments=[_row([1, 2], [5, 6], [1, 1], 0), _row([1, 9], [7, 8], [0, 1], 0)]),
        Sample([1, 3], [4], [-0.5], "stop", 1),
        Sample([1, 3], [5], [-0.5], "stop", 1),
    ]
    rows, episode = training_rows(episodes, multiple=2)
    assert episode.tolist() == [0, 1, 1, 2, 3, -1] and rows[-1].action_mask == [0]
    batch = collate_samples(rows, pad_token_id=0)
    scores = torch.tensor([1.0, 0.0, 0.5, 0.5])
    algo = AlgoConfig(advantage_estimator="group_norm")
    out = compute_advantages_for_batch(
        batch, scores, algo=algo, n_samples_per_prompt=2, generate_max_len=8, kl_coef=0.0, episode=episode
    )
    a = (1.0 - 0.5) / (torch.tensor([1.0, 0.0]).std() + 1e-6)  # torch's std: unbiased, as GRPO's
    mask = batch["action_mask"].bool()
    expected_per_row = torch.tensor([a, -a, -a, 0.0, 0.0, 0.0])
    for r in range(len(rows)):
        got = out["advantages"][r][mask[r]]
        assert torch.allclose(got, expected_per_row[r].expand_as(got), atol=1e-5), (r, got)
    assert (out["advantages"][~mask] == 0).all()
    # the template token of segment 2 (mask 0) is in the row but carries nothing
    assert batch["action_mask"][2].tolist()[1:3] == [0, 1]
