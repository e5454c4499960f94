"""Multi-turn agent rollouts: exact token/mask layout with a scripted engine, loader errors, and a real vLLM run.

The scripted tests use a character tokenizer (token id = ord(char), id 0 = EOS, a special token) and a fake
`generate` whose output depends only on the context length, so every expected sequence is written out by hand.
"""

from __future__ import annotations

import sqlite3
import sys
import threading
import time
from pathlib import Path

import pytest

from openppo.agents import AgentEnv, AgentError, StepResult, engine_generate_fn, load_agent_env, run_agent_episodes
from openppo.errors import UserError
from openppo.ppo.experience import collate_samples
from tests.engines import tiny_engine_actor

REPO = Path(__file__).resolve().parents[2]
GUESS_NUMBER = REPO / "examples" / "agents" / "guess_number.py"
EOS = 0


class CharTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert not add_special_tokens, "feedback must be encoded without special tokens"
        return [ord(c) for c in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "".join("" if (i == EOS and skip_special_tokens) else chr(i) for i in ids)


class ScriptedGenerate:
    """Answers a context of length L with [c, c, EOS], c = chr(ord('a') + L), cut to the request's budget."""

    def __init__(self):
        self.calls: list[tuple[list[list[int]], list[int]]] = []

    def __call__(self, contexts: list[list[int]], budgets: list[int]) -> list[dict]:
        self.calls.append(([list(c) for c in contexts], list(budgets)))
        outs = []
        for ctx, budget in zip(contexts, budgets):
            c = ord("a") + len(ctx)
            ids, lps = [c, c, EOS], [-0.5, -0.25, -0.125]
            outs.append(
                {
                    "token_ids": ids[:budget],
                    "logprobs": lps[:budget],
                    "finish_reason": "stop" if budget >= 3 else "length",
                }
            )
        return outs


class ScriptedEnv(AgentEnv):
    """Feedback "FB", reward 0.5 per turn, done after turn `label`; records the texts it was shown."""

    seen: list[tuple[str, int]] = []

    def step(self, response_text: str, turn: int) -> StepResult:
        ScriptedEnv.seen.append((response_text, turn))
        return StepResult(feedback="FB", reward=0.5, done=turn == self.label, extra={"last_turn": float(turn)})


def _items(*labels) -> list[dict]:
    return [
        {"prompt": "P", "prompt_ids": [ord("P")], "label": label, "index": 10 * (i + 1)}
        for i, label in enumerate(labels)
    ]


def _run(labels, *, n=1, max_turns=3, max_new_tokens=3, max_total_len=100, template="{}", env_cls=None, timeout_s=None):
    generate = ScriptedGenerate()
    ScriptedEnv.seen = []
    samples = run_agent_episodes(
        generate,
        CharTokenizer(),
        _items(*labels),
        n_samples_per_prompt=n,
        env_cls=env_cls or ScriptedEnv,
        max_turns=max_turns,
        max_new_tokens=max_new_tokens,
        max_total_len=max_total_len,
        feedback_template=template,
        env_timeout_s=timeout_s,
    )
    return samples, generate


B, F, J, FB = ord("b"), ord("f"), ord("j"), [ord("F"), ord("B")]


def play_file(path, answer, *, flag="--agent_func_path", n=2, max_turns=4, max_new_tokens=3, timeout_s=None):
    """`n` episodes of one prompt ("P", label "7", index 3) of the agent file at `path` (loaded as `flag` loads it)
    against the scripted engine `answer`; returns the samples and every state its environment recorded in its
    module's SEEN, in order (the Molt and OpenRLHF adapters' tests)."""
    items = [{"prompt": "P", "prompt_ids": [ord("P")], "label": "7", "index": 3}]
    env_cls = load_agent_env(path, flag)
    seen = getattr(sys.modules[env_cls.episode_cls.__module__], "SEEN", [])
    seen.clear()
    samples = run_agent_episodes(
        answer,
        CharTokenizer(),
        items,
        n_samples_per_prompt=n,
        env_cls=env_cls,
        max_turns=max_turns,
        max_new_tokens=max_new_tokens,
        max_total_len=100,
        env_timeout_s=timeout_s,
    )
    return samples, list(seen)


def test_tokens_masks_logprobs_rewards_and_group_order():
    # Item 10 is done after turn 1 (2 model turns); item 20 never says done and stops at max_turns=3.
    samples, generate = _run([1, 99], n=2)
    assert [s.group for s in samples] == [10, 10, 20, 20]
    two_turns, three_turns = samples[0], samples[2]
    assert two_turns.response_ids == [B, B, EOS] + FB + [F + 1, F + 1, EOS]
    assert two_turns.action_mask == [1, 1, 1, 0, 0, 1, 1, 1]
    assert two_turns.rollout_log_probs == [-0.5, -0.25, -0.125, 0.0, 0.0, -0.5, -0.25, -0.125]
    assert three_turns.response_ids == [B, B, EOS] + FB + [F + 1, F + 1, EOS] + FB + [J + 2, J + 2, EOS]
    assert three_turns.action_mask == [1, 1, 1, 0, 0, 1, 1, 1, 0, 0, 1, 1, 1]
    assert three_turns.rollout_log_probs[8:10] == [0.0, 0.0]
    assert [s.reward for s in samples] == [1.0, 1.0, 1.5, 1.5]
    assert [s.extra["rollout/agent_turns"] for s in samples] == [2.0, 2.0, 3.0, 3.0]
    assert three_turns.extra["env/last_turn"] == 2.0
    assert all(s.finish_reason == "stop" and s.prompt_ids == [ord("P")] and s.prompt_text == "P" for s in samples)
    assert two_turns.label == 1 and three_turns.label == 99
    assert two_turns.response_text == "bbFBgg"  # special tokens skipped, like the single-turn reward path
    # The environment saw decoded text without EOS.
    assert ScriptedEnv.seen[:4] == [("bb", 0)] * 4 and ScriptedEnv.seen[4] == ("gg", 1)
    # One generate call per turn, with every still-running episode in it; each context = prompt + response so far.
    assert [len(contexts) for contexts, _ in generate.calls] == [4, 4, 2]
    assert generate.calls[1][0][0] == [ord("P"), B, B, EOS] + FB
    assert all(budgets == [3] * len(budgets) for _, budgets in generate.calls)
    batch = collate_samples(samples, pad_token_id=EOS)
    # Response token i sits at position p + i - 1 of the [B, T-1] grid (p = 1 prompt token).
    assert batch["action_mask"][2].tolist() == three_turns.action_mask
    assert batch["action_mask"][0].tolist() == two_turns.action_mask + [0] * 5


def test_feedback_template_is_applied_before_encoding():
    samples, _ = _run([1], template="<{}>")
    assert samples[0].response_ids == [B, B, EOS, ord("<"), *FB, ord(">"), ord("i"), ord("i"), EOS]
    assert samples[0].action_mask == [1, 1, 1, 0, 0, 0, 0, 1, 1, 1]


def test_total_budget_cuts_the_last_model_turn_and_ends_with_length():
    # 1 prompt + 3 + 2 feedback = 6 tokens, so turn 1 may generate only 2 of its 3 tokens.
    samples, generate = _run([99], max_total_len=8)
    s = samples[0]
    assert [budgets for _, budgets in generate.calls] == [[3], [2]]
    assert s.response_ids == [B, B, EOS] + FB + [F + 1, F + 1]
    assert s.action_mask == [1, 1, 1, 0, 0, 1, 1]
    assert len(s.prompt_ids) + len(s.response_ids) == 8 and s.finish_reason == "length"
    assert s.extra["rollout/agent_turns"] == 2.0


def test_feedback_that_does_not_fit_is_cut_and_ends_the_episode():
    samples, generate = _run([99], max_total_len=5)
    s = samples[0]
    assert len(generate.calls) == 1
    assert s.response_ids == [B, B, EOS, ord("F")] and s.action_mask == [1, 1, 1, 0]
    assert s.rollout_log_probs == [-0.5, -0.25, -0.125, 0.0]
    assert s.finish_reason == "length" and s.extra["rollout/agent_turns"] == 1.0
    # Feedback that fills the last free token leaves no room for a model turn: the episode ends there too.
    samples, generate = _run([99], max_total_len=6)
    assert len(generate.calls) == 1 and samples[0].response_ids == [B, B, EOS] + FB
    assert samples[0].finish_reason == "length"


def test_last_turn_cut_by_max_new_tokens_is_length_and_earlier_cuts_are_not():
    samples, _ = _run([0, 99], max_turns=2, max_new_tokens=2)
    assert samples[0].finish_reason == "length"  # done on its only turn, which was cut
    assert samples[1].finish_reason == "length"  # the cut at turn 0 did not end the episode; turn 1 was cut too
    assert samples[1].action_mask == [1, 1, 0, 0, 1, 1]
    samples, _ = _run([99], max_turns=2, max_new_tokens=3)
    assert samples[0].finish_reason == "stop"


IMG = ord("#")  # the image placeholder of the scripted image prompts; the "engine" expands it into 3 tokens


class ScriptedImageGenerate(ScriptedGenerate):
    """As ScriptedGenerate, for contexts with images: each placeholder expanded into 3, as an engine expands it
    (returned as `prompt_token_ids`), the answer from the expanded context's length; a context whose budget is 1
    samples the placeholder (the engine stops there)."""

    def __init__(self):
        super().__init__()
        self.images: list = []
        self.sent: list = []  # the contexts as given (`calls` has them expanded)

    def __call__(self, contexts, budgets, images=None):
        self.images.append(images)
        self.sent.append([list(c) for c in contexts])
        expanded = [[t for x in ctx for t in ([x] * 3 if x == IMG else [x])] for ctx in contexts]
        outs = super().__call__(expanded, budgets)
        for out, ctx, budget in zip(outs, expanded, budgets):
            out["prompt_token_ids"] = ctx
            if budget == 1:
                out.update(token_ids=[IMG], logprobs=[-1.0], finish_reason="stop")
        return outs


def test_image_prompts_send_their_images_every_turn_and_train_on_the_expanded_prompt():
    items = [{"prompt": "#P", "prompt_ids": [IMG, ord("P")], "label": 99, "index": 10, "images": ["a.png"]}]
    generate = ScriptedImageGenerate()
    kwargs = dict(n_samples_per_prompt=1, env_cls=ScriptedEnv, max_turns=3, max_new_tokens=3)
    (s,) = run_agent_episodes(generate, CharTokenizer(), items, max_total_len=100, **kwargs, image_placeholders=[IMG])
    # each turn the context, placeholder unexpanded, with the prompt's images beside it
    assert generate.images == [[["a.png"]]] * 3
    assert generate.calls[1][0][0] == [IMG] * 3 + [ord("P"), ord("e"), ord("e"), EOS] + FB
    # the sample: the prompt as expanded (what the trainer scores beside the images), the turns as sampled
    assert s.prompt_ids == [IMG] * 3 + [ord("P")] and s.images == ["a.png"]
    # (the scripted engine answers from the expanded context's length: 4, then 4 + 5, then 4 + 10)
    assert s.response_ids == [ord("e"), ord("e"), EOS] + FB + [ord("j"), ord("j"), EOS] + FB + [ord("o")] * 2 + [EOS]
    # the room counts the expanded prompt: of 13 tokens, 4 + 3 + 2 leave 4, so turn 1 samples its 3; of 10 they
    # leave 1 (counted unexpanded: 3), and a turn that samples the placeholder ends the episode, as no later turn
    # could take it back without an image
    generate = ScriptedImageGenerate()
    (s,) = run_agent_episodes(generate, CharTokenizer(), items, max_total_len=13, **kwargs, image_placeholders=[IMG])
    assert [budgets for _, budgets in generate.calls] == [[3], [3]]
    generate = ScriptedImageGenerate()
    (s,) = run_agent_episodes(generate, CharTokenizer(), items, max_total_len=10, **kwargs, image_placeholders=[IMG])
    assert [budgets for _, budgets in generate.calls] == [[3], [1]]
    assert s.response_ids == [ord("e"), ord("e"), EOS] + FB + [IMG] and s.finish_reason == "stop"
    assert s.extra["rollout/agent_turns"] == 2.0 and len(s.prompt_ids) + len(s.response_ids) == 10


class ShowsAPicture(AgentEnv):
    """Shows "b.png" with its first feedback ("#?": the placeholder, then a question); done after turn 1."""

    feedback = "#?"

    def step(self, response_text, turn):
        return StepResult(feedback=self.feedback, images=["b.png"] if turn == 0 else [], done=turn == 1)


def _expand(text, images):
    """The scripted processor: each placeholder into 3, as the scripted engine expands it."""
    return [t for c in text for t in ([IMG] * 3 if c == "#" else [ord(c)])]


def _shown(env_cls=ShowsAPicture, expand=_expand, max_images=2, max_total_len=100):
    items = [{"prompt": "#P", "prompt_ids": [IMG, ord("P")], "label": 0, "index": 10, "images": ["a.png"]}]
    generate = ScriptedImageGenerate()
    kwargs = dict(n_samples_per_prompt=1, env_cls=env_cls, max_turns=3, max_new_tokens=3, max_total_len=max_total_len)
    samples = run_agent_episodes(
        generate,
        CharTokenizer(),
        items,
        **kwargs,
        image_placeholders=[IMG],
        expand_images=expand,
        max_images=max_images,
    )
    return samples, generate


def test_feedback_images_go_to_the_engine_unexpanded_and_into_the_row_expanded():
    (s,), generate = _shown()
    # turn 1's context: the feedback's placeholder unexpanded, the picture beside the prompt's
    assert generate.images == [[["a.png"]], [["a.png", "b.png"]]]
    assert generate.sent[1][0] == [IMG, ord("P"), ord("e"), ord("e"), EOS, IMG, ord("?")]
    # the row: the feedback as expanded (the engine expanded turn 1's context into exactly the row so far)
    assert s.prompt_ids == [IMG] * 3 + [ord("P")] and s.images == ["a.png", "b.png"]
    assert s.response_ids == [ord("e"), ord("e"), EOS] + [IMG] * 3 + [ord("?")] + [ord("l")] * 2 + [EOS]
    assert s.action_mask == [1, 1, 1, 0, 0, 0, 0, 1, 1, 1]
    assert s.rollout_log_probs[3:7] == [0.0] * 4
    # feedback with images that does not fit (4 + 3 + 4 of 11 leave no turn) ends the episode without it
    (s,), generate = _shown(max_total_len=11)
    assert len(generate.calls) == 1 and s.response_ids == [ord("e"), ord("e"), EOS] and s.finish_reason == "length"
    assert s.images == ["a.png"]


def test_feedback_images_that_the_run_cannot_show_stop_it_naming_the_env():
    where = r"ShowsAPicture.step \(prompt index 10, turn 0\)"
    with pytest.raises(AgentError, match=where + r" showed 1 image\(s\), 1 were shown before, and "):
        _shown(max_images=1)  # --max_images_per_prompt counts the prompt's too
    with pytest.raises(AgentError, match=where + r" showed 1 image\(s\): feedback images need image prompts"):
        _shown(expand=None)
    no_placeholder = type("NoPlaceholder", (ShowsAPicture,), {"feedback": "?"})
    with pytest.raises(AgentError, match=r"feedback whose text holds 0 image placeholder\(s\)"):
        _shown(env_cls=no_placeholder)
    # a processor that expands the image otherwise than the engine: the next turn's context gives it away
    with pytest.raises(AgentError, match="the engine expanded the images of the feedback into other tokens"):
        _shown(expand=lambda text, images: [t for c in text for t in ([IMG] * 2 if c == "#" else [ord(c)])])


def test_env_errors_name_the_env_prompt_and_turn():
    class Broken(AgentEnv):
        def step(self, response_text, turn):
            return {"reward": 1.0}

    with pytest.raises(AgentError, match=r"Broken.step \(prompt index 10, turn 0\) returned dict"):
        _run([0], env_cls=Broken)


def test_engine_generate_fn_sends_each_prompt_its_own_budget_in_one_call():
    calls = []

    def engine_generate(prompts, *, n, max_new_tokens, temperature):
        calls.append((len(prompts), n, max_new_tokens, temperature))
        return [
            [{"token_ids": [p[0]] * budget, "logprobs": [0.0] * budget, "finish_reason": "length"}]
            for p, budget in zip(prompts, max_new_tokens)
        ]

    out = engine_generate_fn(engine_generate, temperature=0.7)([[1], [2], [3]], [4, 2, 4])
    assert [o["token_ids"] for o in out] == [[1] * 4, [2] * 2, [3] * 4]
    assert calls == [(3, 1, [4, 2, 4], 0.7)]


# -- loading an agent file -------------------------------------------------------------------------------------------


def test_load_agent_env_errors_name_the_flag(tmp_path):
    with pytest.raises(UserError, match="--agent_func_path: agent file .* not found"):
        load_agent_env(tmp_path / "missing.py")
    (tmp_path / "env.txt").write_text("x = 1\n")
    with pytest.raises(UserError, match="--agent_func_path: .* is not a .py file"):
        load_agent_env(tmp_path / "env.txt")
    (tmp_path / "no_agent.py").write_text("class Env:\n    pass\n")
    with pytest.raises(UserError, match="--agent_func_path: .* defines no Agent; add class Agent\\(AgentEnv\\)"):
        load_agent_env(tmp_path / "no_agent.py")
    (tmp_path / "plain.py").write_text("class Agent:\n    pass\n")
    with pytest.raises(UserError, match="--agent_func_path: Agent in .* is not a subclass of openppo.agents.AgentEnv"):
        load_agent_env(tmp_path / "plain.py")
    (tmp_path / "abstract.py").write_text("from openppo.agents import AgentEnv\nclass Agent(AgentEnv):\n    pass\n")
    with pytest.raises(UserError, match="--agent_func_path: Agent in .* does not implement step"):
        load_agent_env(tmp_path / "abstract.py")
    (tmp_path / "broken.py").write_text("import no_such_module_xyz\n")
    with pytest.raises(UserError, match="--agent_func_path: importing .* failed: ModuleNotFoundError"):
        load_agent_env(tmp_path / "broken.py")


def test_guess_number_example():
    Agent = load_agent_env(GUESS_NUMBER)
    env = Agent("prompt", "7")
    assert env.step("I guess 3, maybe 9", 0) == StepResult(feedback="higher", extra={"guess_number/solved": 0.0})
    assert env.step("9", 1).feedback == "lower"
    assert env.step("no idea", 2).feedback.startswith("Answer with one integer")
    result = env.step("It is 7.", 3)
    assert (result.reward, result.done, result.extra) == (1.0, True, {"guess_number/solved": 1.0})


# -- real vLLM engine ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine():
    with tiny_engine_actor(kv_cache_bytes=256 << 20) as actor:
        yield actor


def _matching_output(records, context: list[int], rest: list[int]) -> dict:
    """The recorded completion for `context` whose tokens start `rest` (two episodes may share a context)."""
    for ctx, out in records:
        if ctx == context and rest[: len(out["token_ids"])] == out["token_ids"]:
            return out
    raise AssertionError(f"no recorded completion for a context of {len(context)} tokens")


@pytest.mark.slow
def test_guess_number_on_vllm_masks_exactly_the_feedback(engine):
    import ray
    from transformers import AutoTokenizer

    from tests.model_cache import tiny_model_dir

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir())
    Agent = load_agent_env(GUESS_NUMBER)
    template = "\nUser: {}\nAssistant:"
    items = [
        {"prompt": p, "prompt_ids": tokenizer.encode(p), "label": label, "index": i}
        for i, (p, label) in enumerate([("Guess my digit:", 3), ("Pick a number from 0 to 9:", 8)])
    ]
    base = engine_generate_fn(
        lambda ids, **kw: ray.get(engine.generate.remote(ids, **kw), timeout=120), temperature=1.0, top_p=1.0
    )
    records, num_calls = [], [0]

    def generate(contexts, budgets):
        num_calls[0] += 1
        outs = base(contexts, budgets)
        records.extend(zip(contexts, outs))
        return outs

    t0 = time.monotonic()
    samples = run_agent_episodes(
        generate,
        tokenizer,
        items,
        n_samples_per_prompt=2,
        env_cls=Agent,
        max_turns=3,
        max_new_tokens=8,
        max_total_len=128,
        feedback_template=template,
    )
    print(f"2 prompts x 2 samples x 3 turns on vLLM: {time.monotonic() - t0:.2f} s, {num_calls[0]} generate calls")
    assert [s.group for s in samples] == [0, 0, 1, 1] and num_calls[0] <= 3

    num_feedback_tokens = 0
    for s in samples:
        # Replay the episode: model tokens from the engine's records, feedback from a fresh environment.
        env, resp, offset, expected_mask = Agent(s.prompt_text, s.label), s.response_ids, 0, []
        for turn in range(3):
            out = _matching_output(records, s.prompt_ids + resp[:offset], resp[offset:])
            n = len(out["token_ids"])
            assert s.rollout_log_probs[offset : offset + n] == out["logprobs"]
            expected_mask += [1] * n
            offset += n
            result = env.step(tokenizer.decode(out["token_ids"], skip_special_tokens=True), turn)
            if result.done or turn == 2:
                break
            feedback = tokenizer.encode(template.format(result.feedback), add_special_tokens=False)
            assert resp[offset : offset + len(feedback)] == feedback
            assert s.rollout_log_probs[offset : offset + len(feedback)] == [0.0] * len(feedback)
            expected_mask += [0] * len(feedback)
            offset += len(feedback)
            num_feedback_tokens += len(feedback)
        assert offset == len(resp) and s.action_mask == expected_mask
        assert s.extra["rollout/agent_turns"] == turn + 1 and s.reward == float(result.done)
    assert num_feedback_tokens > 0, "no episode got feedback: the test checked no masking"

    batch = collate_samples(samples, tokenizer.pad_token_id)
    for row, s in enumerate(samples):
        p = len(s.prompt_ids)
        assert batch["action_mask"][row, p - 1 : p - 1 + len(s.response_ids)].tolist() == s.action_mask
        assert batch["action_mask"][row].sum().item() == sum(s.action_mask)


def test_an_env_call_that_outlives_agent_timeout_stops_the_rollout_naming_it():
    """A step (or construction) that never returns raises AgentError after `env_timeout_s`; the rollout after it
    runs on a new thread while the late call's thread waits."""
    release = threading.Event()

    class Hangs(AgentEnv):
        def step(self, response_text, turn):
            release.wait(60)
            return StepResult(reward=1.0, done=True)

    class HangsBuilding(ScriptedEnv):
        def __init__(self, prompt, label):
            release.wait(60)
            super().__init__(prompt, label)

    def run(env_cls):
        return _run([0], env_cls=env_cls, timeout_s=0.2)[0]

    try:
        with pytest.raises(AgentError, match=r"^Hangs.step \(prompt index 10, turn 0\) did not return within 0.2 s "):
            run(Hangs)
        with pytest.raises(AgentError, match=r"^HangsBuilding\(prompt index 10\) did not return within 0.2 s \(--"):
            run(HangsBuilding)
        assert run(ScriptedEnv)[0].reward == 0.5  # two threads still wait in the late calls
    finally:
        release.set()


def test_an_env_is_built_and_stepped_on_one_thread():
    """Construction and steps share a thread, so an environment may hold thread-bound objects: a sqlite connection
    refuses use from any thread but its creator's."""

    class Counts(AgentEnv):
        def __init__(self, prompt, label):
            super().__init__(prompt, label)
            self.db = sqlite3.connect(":memory:")
            self.db.execute("create table turns (n integer)")

        def step(self, response_text, turn):
            self.db.execute("insert into turns values (?)", (turn,))
            (count,) = self.db.execute("select count(*) from turns").fetchone()
            return StepResult(feedback="FB", reward=float(count), done=turn == 1)

    samples, _ = _run([0, 0], n=2, env_cls=Counts, timeout_s=30)
    assert [s.reward for s in samples] == [3.0] * 4  # 1 + 2: each episode's own table
