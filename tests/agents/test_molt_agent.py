"""Molt's agent interface (`--train.agent_path`, openppo/agents/molt.py): a Molt agent file, which imports
`molt.agents`, is played as an openppo multi-turn environment. Scripted engine and character tokenizer as in
test_agent_rollout.py, so every state the environment sees and every token of the samples is written out by hand;
the run with real engines is tests/ppo/test_molt_quick_start.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from openppo.agents import AgentError, load_agent_env
from openppo.errors import UserError
from tests.agents.test_agent_rollout import EOS, play_file

VOWELS_AGENT = Path(__file__).resolve().parent / "molt_vowels_agent.py"
FB = [ord(c) for c in " Vowels only: "]


def answer(contexts, budgets):
    """Every turn answers "ax" and EOS: a third of its characters (EOS included, as Molt decodes it) are vowels."""
    return [{"token_ids": [ord("a"), ord("x"), EOS], "logprobs": [-0.5, -0.25, -0.125], "finish_reason": "stop"}] * len(
        contexts
    )


def play(path, **kwargs):
    """`n` episodes of one prompt; returns the samples and every state the Molt environment saw, in order."""
    return play_file(path, answer, flag="--train.agent_path", **kwargs)


def test_a_molt_env_plays_its_turns_with_molts_state_and_result():
    samples, seen = play(VOWELS_AGENT)
    turn = [ord("a"), ord("x"), EOS]
    assert len(samples) == 2
    for s in samples:
        # two model turns with the raw feedback between them (masked out), then the environment's terminated
        assert s.response_ids == turn + FB + turn and s.action_mask == [1] * 3 + [0] * len(FB) + [1] * 3
        assert s.rollout_log_probs == [-0.5, -0.25, -0.125] + [0.0] * len(FB) + [-0.5, -0.25, -0.125]
        assert s.reward == pytest.approx(2 / 3)  # the turns' rewards summed, each the first element of its tensor
        assert s.extra["rollout/agent_turns"] == 2.0 and s.finish_reason == "stop"
        # info's numbers and the score logged (the last turn's), its text not
        assert s.extra["env/vowel_share"] == pytest.approx(1 / 3) and s.extra["env/score"] == 0.0
        assert "env/answer" not in s.extra
    # Molt's state, turn by turn (both episodes' first turns, then their second): the context so far as text, the
    # turn decoded with its special tokens (EOS is chr(0)), the label, no sampling parameters
    assert [st["observation_text"] for st in seen] == ["P", "P", "Pax\x00 Vowels only: ", "Pax\x00 Vowels only: "]
    assert all(st["action_text"] == "ax\x00" and st["label"] == "7" and st["sampling_params"] is None for st in seen)


def test_max_turns_still_caps_a_molt_episode():
    samples, seen = play(VOWELS_AGENT, n=1, max_turns=1)
    assert samples[0].response_ids == [ord("a"), ord("x"), EOS] and len(seen) == 1


MOLT_FILE = """
import torch
from molt.agents.base import Env, Result, StepEnvRunner


class E(Env):
    async def reset(self, state):
        return {BODY_RESET}

    async def step(self, state):
        return {BODY_STEP}


class AgentRunner(StepEnvRunner):
    def __init__(self):
        super().__init__(E)
"""


def molt_file(tmp_path, reset="state", step="Result(reward=1.0)"):
    path = tmp_path / "agent.py"
    path.write_text(MOLT_FILE.replace("{BODY_RESET}", reset).replace("{BODY_STEP}", step))
    return path


@pytest.mark.parametrize(
    "reset, step, message",
    [
        ("{**state, 'observation': 'other'}", "Result(reward=1.0)", "E.reset rewrote the first observation"),
        ("state", "Result(reward=None)", "E.step returned a Result without a scalar reward"),
        # (images with feedback need image prompts: this run's are text; images with a last step are unused)
        (
            "state",
            "Result(reward=1.0, images=['x.png'], observation='<image>', terminated=False)",
            r"MoltE.step \(prompt index 3, turn 0\) showed 1 image\(s\): feedback images need image prompts",
        ),
        ("state", "Result(reward=1.0, sampling_params=object())", "E.step returned sampling_params"),
        ("state", "1.0", "E.step returned float; return a Result"),
    ],
)
def test_what_openppo_does_not_do_is_refused_naming_the_env(tmp_path, reset, step, message):
    with pytest.raises(AgentError, match=message):
        play(molt_file(tmp_path, reset, step), n=1)


def test_a_molt_file_loads_with_its_errors_named(tmp_path):
    # a terminated=False episode runs to --agent_max_turns, as an --agent_func_path one does
    samples, _ = play(molt_file(tmp_path, step="Result(reward=0.25, observation='again', terminated=False)"), n=1)
    assert samples[0].reward == 1.0 and samples[0].extra["rollout/agent_turns"] == 4.0
    chat = tmp_path / "chat.py"
    chat.write_text(
        "from molt.agents import ChatAgent, ChatAgentRunner\n"
        "class A(ChatAgent):\n    pass\n"
        "class AgentRunner(ChatAgentRunner):\n    def __init__(self):\n        super().__init__(A)\n"
    )
    with pytest.raises(UserError, match=r"--train.agent_path: .*chat.py holds a Molt ChatAgentRunner, played through"):
        load_agent_env(chat, "--train.agent_path")
    odd = tmp_path / "odd.py"
    odd.write_text("from molt.agents.base import Runner\nclass AgentRunner(Runner):\n    pass\n")
    with pytest.raises(UserError, match=r"odd.py: AgentRunner is neither a StepEnvRunner\(Env\) nor a ChatAgentRunner"):
        load_agent_env(odd, "--train.agent_path")
    broken = tmp_path / "broken.py"
    broken.write_text("from molt.agents import Env\nfrom molt.utils import grader\n")
    with pytest.raises(UserError, match=r"--train.agent_path: importing .*broken.py failed: ModuleNotFoundError"):
        load_agent_env(broken, "--train.agent_path")
    neither = tmp_path / "neither.py"
    neither.write_text("x = 1\n")
    fix = "defines no Agent; add class Agent.*, Molt's class AgentRunner.*, or OpenRLHF's class AgentExecutor"
    with pytest.raises(UserError, match=fix):
        load_agent_env(neither, "--train.agent_path")


def test_a_molt_chat_file_is_the_runs_agent_program_and_its_prompts_keep_their_messages(tmp_path):
    """--train.agent_path with a ChatAgentRunner file: the run plays it through its endpoint (an agent program,
    no step episodes), and the prompts it gets keep their unrendered messages and tools; a StepEnvRunner file stays
    a multi-turn environment."""
    import datasets
    from transformers import AutoTokenizer

    from openppo.cli.flags_doc import clis
    from openppo.config.schema import parse_config
    from openppo.ppo import launch
    from tests.model_cache import tiny_model_dir

    chat = tmp_path / "chat.py"
    chat.write_text(
        "from molt.agents import ChatAgent, ChatAgentRunner, Result\n"
        "class A(ChatAgent):\n    async def run(self, ctx):\n        return Result(reward=1.0)\n"
        "class AgentRunner(ChatAgentRunner):\n    def __init__(self):\n        super().__init__(A)\n"
    )
    base = ["--pretrain", str(tiny_model_dir()), "--apply_chat_template", "--generate_max_len", "12"]
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir())
    ppo = clis()["train_ppo_ray"]
    cfg = parse_config(ppo, [*base, "--train.agent_path", str(chat), "--top_k", "5"], "train_ppo_ray")
    episodes, program = launch.load_agent(cfg, tokenizer)
    assert episodes is None and program.name == "chat.py:A"
    step_cfg = parse_config(ppo, [*base, "--train.agent_path", str(VOWELS_AGENT)], "train_ppo_ray")
    episodes, program = launch.load_agent(step_cfg, tokenizer)
    assert callable(episodes) and program is None
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    rows = [
        {"q": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q1"}], "tools": tools},
        {"q": [{"role": "user", "content": "Q2"}], "tools": None},
    ]
    cfg.data.input_key, cfg.data.tools_key = "q", "tools"
    prompts = launch.load_prompts(cfg, tokenizer, datasets.Dataset.from_list(rows), keep_messages=True)
    assert [prompts[i]["messages"] for i in range(2)] == [rows[0]["q"], rows[1]["q"]]
    assert prompts[0]["tools"] == tools and prompts[1]["tools"] is None
    assert prompts[0]["prompt"].startswith("<|im_start|>system\nS")  # the rendered text stays the prompt
    assert "messages" not in launch.load_prompts(cfg, tokenizer, datasets.Dataset.from_list(rows))[0]


def test_a_turns_molt_steps_are_awaited_together(tmp_path):
    """Every running episode's step of a turn is awaited at once, as Molt awaits them: here each step waits at a
    barrier for all four episodes' steps of the turn, which one-by-one stepping never reaches (its first step would
    wait out --agent_timeout). A late step is named; the others are cancelled with it."""
    body = "(await BARRIER.wait(), Result(reward=1.0, observation='next', terminated=False))[1]"
    path = molt_file(tmp_path, step=body)
    path.write_text("import asyncio\nBARRIER = asyncio.Barrier(4)\n" + path.read_text())
    samples, _ = play(path, n=4, max_turns=2, timeout_s=30)
    assert [s.reward for s in samples] == [2.0] * 4  # two turns of four concurrent steps
    late = molt_file(tmp_path, step="(await asyncio.sleep(3600), Result(reward=1.0))[1]")
    late.write_text("import asyncio\n" + late.read_text())
    with pytest.raises(AgentError, match=r"^MoltE.step \(prompt index 3, turn 0\) did not return within 0.5 s"):
        play(late, n=2, timeout_s=0.5)
    # a step's own TimeoutError (its tool server's) is its error, not a late step
    own = molt_file(tmp_path, step="(_ for _ in ()).throw(TimeoutError('tool server'))")
    with pytest.raises(AgentError, match=r"^MoltE.step \(prompt index 3, turn 0\) raised TimeoutError: tool server"):
        play(own, n=2, timeout_s=30)
