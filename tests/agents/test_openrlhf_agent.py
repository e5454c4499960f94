"""OpenRLHF's agent interface (`--agent_func_path`, openppo/agents/openrlhf_agent.py): an OpenRLHF agent file, which
imports `openrlhf.utils.agent`, is played as an openppo multi-turn environment. Scripted engine and character
tokenizer as in test_agent_rollout.py, so every state the environment sees and every token of the samples is written
out by hand; the run with real engines is tests/ppo/test_openrlhf_agent_recipe.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from openppo.agents import AgentError, load_agent_env
from openppo.errors import UserError
from tests.agents.test_agent_rollout import EOS, play_file

VOWELS_AGENT = Path(__file__).resolve().parent / "openrlhf_vowels_agent.py"
FB = [ord(c) for c in " Vowels only: "]
TURN = [ord("a"), EOS, ord("x"), EOS]  # a special token inside the turn, and the stop token that ends it
LOGPROBS = [-0.5, -0.25, -0.125, -0.0625]


def answer(contexts, budgets):
    """Every turn answers `TURN`, cut to its budget ("length" then, "stop" when it ends on EOS)."""
    return [
        {"token_ids": TURN[:b], "logprobs": LOGPROBS[:b], "finish_reason": "stop" if b >= len(TURN) else "length"}
        for b in budgets
    ]


def play(path, *, max_new_tokens=4, **kwargs):
    """`n` episodes of one prompt; returns the samples and every state the OpenRLHF environment saw, in order."""
    return play_file(path, answer, max_new_tokens=max_new_tokens, **kwargs)


def test_an_openrlhf_agent_plays_its_turns_with_openrlhfs_states_and_dict():
    samples, seen = play(VOWELS_AGENT)
    assert len(samples) == 2
    for s in samples:
        # two model turns with the raw feedback between them (masked out); the last turn's feedback is not appended
        assert s.response_ids == TURN + FB + TURN and s.action_mask == [1] * 4 + [0] * len(FB) + [1] * 4
        assert s.rollout_log_probs == LOGPROBS + [0.0] * len(FB) + LOGPROBS
        # action_text "a\x00x": a third vowels per turn, the two turns' rewards summed (first element of a tensor)
        assert s.reward == pytest.approx(2 / 3)
        assert s.extra["rollout/agent_turns"] == 2.0 and s.finish_reason == "stop"
        # extra_logs' numbers and the scores logged (the last turn's), the text not
        assert s.extra["env/vowel_share"] == pytest.approx(1 / 3) and s.extra["env/score"] == 0.0
        assert "env/answer" not in s.extra
    # OpenRLHF's states, turn by turn (both episodes' first turns, then their second): the context so far as text,
    # the turn as vLLM's .text with special tokens kept (EOS is chr(0)) but without the stop token that ended it, the
    # label, no sampling parameters
    assert [st["observation_text"] for st in seen] == ["P", "P", "Pa\x00x Vowels only: ", "Pa\x00x Vowels only: "]
    assert all(st["action_text"] == "a\x00x" and st["label"] == "7" and st["sampling_params"] is None for st in seen)


def test_a_turn_cut_by_its_budget_keeps_its_last_token_in_the_text():
    samples, seen = play(VOWELS_AGENT, n=1, max_new_tokens=3)
    assert samples[0].response_ids == TURN[:3] + FB + TURN[:3] and samples[0].finish_reason == "length"
    assert [st["action_text"] for st in seen] == ["a\x00x", "a\x00x"]
    samples, seen = play(VOWELS_AGENT, n=1, max_new_tokens=2)  # ends on EOS, but cut: nothing stopped it
    assert [st["action_text"] for st in seen] == ["a\x00", "a\x00"]


OPENRLHF_FILE = """
import torch
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        pass

    async def reset(self, states, **kwargs):
        return {BODY_RESET}

    async def step(self, states, **kwargs):
        return {BODY_STEP}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
"""
DONE = "{'rewards': torch.tensor(1.0), 'environment_feedback': '', 'done': True"


def openrlhf_file(tmp_path, reset="states", step=DONE + "}", name="agent.py"):
    path = tmp_path / name
    path.write_text(OPENRLHF_FILE.replace("{BODY_RESET}", reset).replace("{BODY_STEP}", step))
    return path


@pytest.mark.parametrize(
    "reset, step, message",
    [
        ("{'observation': 'other'}", DONE + "}", "AgentInstance.reset rewrote the first observation"),
        ("'P'", DONE + "}", "AgentInstance.reset returned str; return the state dict"),
        ("states", "1.0", "AgentInstance.step returned float; return a dict with rewards, environment_feedback, done"),
        ("states", "{'rewards': 1.0}", "AgentInstance.step returned a dict without environment_feedback, done"),
        ("states", DONE.replace("torch.tensor(1.0)", "'high'") + "}", "AgentInstance.step returned rewards 'high'"),
        (
            "states",
            DONE.replace("True", "False") + ", 'environment_images': ['x.png']}",
            r"OpenRLHFAgentInstance.step \(prompt index 3, turn 0\) showed 1 image\(s\): feedback images need image",
        ),
        ("states", DONE + ", 'sampling_params': object()}", "AgentInstance.step returned sampling_params"),
    ],
)
def test_what_openppo_does_not_do_is_refused_naming_the_instance(tmp_path, reset, step, message):
    with pytest.raises(AgentError, match=message):
        play(openrlhf_file(tmp_path, reset, step), n=1)


def test_an_episode_that_is_not_done_runs_to_max_turns(tmp_path):
    step = "{'rewards': torch.tensor([0.25]), 'environment_feedback': 'again', 'done': False, 'scores': 0.5}"
    samples, _ = play(openrlhf_file(tmp_path, step=step), n=1)
    assert samples[0].reward == 1.0 and samples[0].extra["rollout/agent_turns"] == 4.0
    assert samples[0].extra["env/score"] == 0.5


def test_executors_openppo_cannot_play_are_refused_at_load_naming_the_flag(tmp_path):
    path = openrlhf_file(tmp_path)
    text = path.read_text()
    cases = {
        # its own turn loop (OpenRLHF's OpenAI-server and NeMo-Gym executors)
        "own_execute.py": (
            text + "    async def execute(self, *args, **kwargs):\n        return {}\n",
            "AgentExecutor overrides execute; openppo drives the turns",
        ),
        "base.py": (
            text.replace("MultiTurnAgentExecutor)", "AgentExecutorBase)").replace(
                "import AgentInstanceBase,", "import AgentExecutorBase, AgentInstanceBase,"
            ),
            "AgentExecutor takes|AgentExecutor is not a MultiTurnAgentExecutor",
        ),
        # OpenRLHF 0.8's executor, given the engine
        "old.py": (
            text.replace(
                "def __init__(self):\n        super().__init__(AgentInstance)",
                "def __init__(self, max_steps, max_length, llm_engine, hf_tokenizer, result_queue):\n        pass",
            ),
            r"AgentExecutor takes max_steps, max_length, llm_engine, hf_tokenizer, result_queue \(OpenRLHF < 0.9",
        ),
        "no_step.py": (
            text.replace("    async def step(self, states, **kwargs):\n        return " + DONE + "}\n", ""),
            "AgentInstance in .*no_step.py does not implement async step",
        ),
        "not_instance.py": (
            text.replace("super().__init__(AgentInstance)", "super().__init__(dict)"),
            r"AgentExecutor\(\) of .*not_instance.py raised TypeError: MultiTurnAgentExecutor\(agent_instance_cls\)",
        ),
    }
    for name, (body, message) in cases.items():
        (tmp_path / name).write_text(body)
        with pytest.raises(UserError, match=f"^--agent_func_path: .*({message})"):
            load_agent_env(tmp_path / name)
    # a custom executor on the base class, which has no AgentInstance to play
    custom = tmp_path / "custom.py"
    custom.write_text(
        "from openrlhf.utils.agent import AgentExecutorBase\n"
        "class AgentExecutor(AgentExecutorBase):\n"
        "    async def execute(self, *args, **kwargs):\n        return {}\n"
    )
    with pytest.raises(UserError, match="AgentExecutor is not a MultiTurnAgentExecutor: it drives the engine itself"):
        load_agent_env(custom)
