"""FunctionReward on the example files and on broken ones; the output checks every source shares."""

from __future__ import annotations

import logging
import math

import pytest
import torch

from openppo.errors import UserError
from openppo.rewards import FunctionReward, RewardError, RewardResult
from openppo.rewards.base import to_result
from tests.rewards.conftest import EXAMPLES

Q = "What is 3 + 4? Reply with only the final number."


def test_arithmetic_example():
    source = FunctionReward(str(EXAMPLES / "arithmetic.py"))
    responses = [" 7", " It is 3 + 4 = 7.", " 8", " seven"]
    result = source.score([Q + r for r in responses], [Q] * 4, ["7"] * 4)
    # " seven" has no number: 0, although the prompt itself ends in numbers (3, 4).
    assert result.rewards == [1.0, 1.0, 0.0, 0.0]
    assert result.scores == result.rewards
    assert result.extra_logs == {"has_number": [1.0, 1.0, 1.0, 0.0]}


def test_target_token_example():
    source = FunctionReward(str(EXAMPLES / "target_token.py"))
    prompts = ["Say cat:", "Say cat:", "Say dog:", "Say dog:"]
    responses = [" cat dog Cat.", " cat cat<|im_end|>", " ", " dogs dog, bird dog!"]
    result = source.score([p + r for p, r in zip(prompts, responses)], prompts, ["cat", "cat", "dog", " dog "])
    assert result.rewards == pytest.approx([2 / 3, 1.0, 0.0, 0.5])
    assert result.extra_logs == {}


def test_example_rejects_query_without_its_prompt():
    source = FunctionReward(str(EXAMPLES / "arithmetic.py"))
    with pytest.raises(RewardError, match="does not start with its prompt"):
        source.score(["7"], [Q], ["7"])


def test_empty_batch_does_not_call_the_function(tmp_path):
    path = tmp_path / "boom.py"
    path.write_text("def reward_func(q, p, l, **kw):\n    raise RuntimeError('called')\n")
    assert FunctionReward(str(path)).score([], [], []).rewards == []


@pytest.mark.parametrize(
    "text, match",
    [
        (None, "not found"),
        ("def other(q, p, l):\n    return [0.0]\n", "defines no reward_func"),
        ("reward_func = 3\n", "not a function"),
        ("def reward_func(q, p, l:\n", "importing .* failed: SyntaxError"),
        ("import no_such_module_xyz\n", "importing .* failed: ModuleNotFoundError"),
    ],
)
def test_bad_files_are_user_errors(tmp_path, text, match):
    path = tmp_path / "reward.py"
    if text is not None:
        path.write_text(text)
    with pytest.raises(UserError, match=match) as info:
        FunctionReward(str(path))
    assert "--remote_rm_url" in str(info.value) and str(path) in str(info.value)


def raising_file(tmp_path):
    path = tmp_path / "picky.py"
    path.write_text(
        "def reward_func(queries, prompts, labels, **kwargs):\n    return [1.0 / len(label) for label in labels]\n"
    )
    return str(path)


def test_raising_function_names_the_failing_sample(tmp_path):
    source = FunctionReward(raising_file(tmp_path))
    long_query = "Q" * 150 + "x" * 1000
    with pytest.raises(RewardError) as info:
        source.score(["ok", long_query, "also bad"], ["", "", ""], ["a", "", ""])
    text = str(info.value)
    assert "ZeroDivisionError" in text and "picky.py" in text
    assert "first failing sample #1" in text and "Q" * 150 in text
    assert "x" * 300 not in text and "chars)" in text  # the query is cut to ~200 characters
    assert isinstance(info.value.__cause__, ZeroDivisionError)  # the user's traceback is kept


def test_default_reward_replaces_the_batch(tmp_path, caplog):
    source = FunctionReward(raising_file(tmp_path), default_reward=-1.0)
    with caplog.at_level(logging.WARNING):
        result = source.score(["a", "b", "c"], ["", "", ""], ["x", "", "yy"])
    assert result.rewards == [-1.0, -1.0, -1.0] and result.scores == [-1.0, -1.0, -1.0]
    assert source.num_defaulted == 3
    assert "ZeroDivisionError" in caplog.text and "3 samples" in caplog.text
    assert source.score(["a"], [""], ["xy"]).rewards == [0.5]  # later batches are scored normally


@pytest.mark.parametrize(
    "output, match",
    [
        ([1.0, 2.0], "2 values for 3 queries"),
        ([1.0, float("nan"), 0.0], r"rewards\[1\] is nan"),
        ([1.0, "2", 0.0], r"rewards\[1\] is str"),
        ("1,2,3", "must be a list"),
        ({"scores": [1, 2, 3]}, "no 'rewards'"),
        ({"rewards": [1, 2, 3], "score": [1, 2, 3]}, "unknown keys"),
        ({"rewards": [1, 2, 3], "scores": [1, math.inf, 3]}, r"scores\[1\] is inf"),
        ({"rewards": [1, 2, 3], "extra_logs": {"acc": [1, 2]}}, r"extra_logs\['acc'\] has 2 values"),
    ],
)
def test_bad_outputs_name_the_source(output, match):
    with pytest.raises(RewardError, match=match) as info:
        to_result(output, 3, "my source")
    assert str(info.value).startswith("my source:")


def test_accepted_output_forms():
    assert to_result(torch.tensor([1.0, 0.5]), 2, "s").rewards == [1.0, 0.5]
    assert to_result((1, 0), 2, "s").rewards == [1.0, 0.0]
    full = to_result(
        {"rewards": torch.tensor([1.0, 0.0]), "scores": [1, 0], "extra_logs": {"len": [3, 4], "const": 2.0}}, 2, "s"
    )
    assert full.scores == [1.0, 0.0] and full.extra_logs == {"len": [3.0, 4.0], "const": [2.0, 2.0]}
    assert RewardResult(rewards=[0.5]).scores == [0.5]


def test_function_receives_lists_and_output_is_checked(tmp_path):
    path = tmp_path / "short.py"
    path.write_text("def reward_func(queries, prompts, labels, **kwargs):\n    return [0.0]\n")
    with pytest.raises(RewardError, match=r"reward_func in .*short.py: rewards has 1 values for 2 queries"):
        FunctionReward(str(path)).score(["a", "b"], ["", ""], [None, None])


HANGING = """
import threading

RELEASE = threading.Event()
THREADS = []


def reward_func(queries, prompts, labels, **kwargs):
    THREADS.append(threading.get_ident())
    if "hang" in labels:
        RELEASE.wait()
    return [float(len(q)) for q in queries]
"""


def test_a_late_reward_func_stops_the_run_or_gets_the_default(tmp_path, caplog):
    """A reward_func that never returns is an error naming the function, the batch and --reward_func_timeout (or,
    with a default_reward, that reward and a warning), not a hang; the next batch is scored on a new thread, and
    calls that return stay on one thread (a thread-bound object made in one call works in the next)."""
    path = tmp_path / "hangs.py"
    path.write_text(HANGING)
    source = FunctionReward(str(path), timeout_s=0.5)
    defaulting = FunctionReward(str(path), timeout_s=0.5, default_reward=-1.0)
    module = source.func.__globals__
    try:
        assert source.score(["ab", "c"], ["", ""], ["x", "y"]).rewards == [2.0, 1.0]
        assert source.score(["abc"], [""], ["x"]).rewards == [3.0]
        assert len(set(module["THREADS"])) == 1
        with pytest.raises(RewardError) as info:
            source.score(["abcd", "e"], ["", ""], ["x", "hang"])
        text = str(info.value)
        assert "hangs.py did not return within 0.5 s on a batch of 2 samples (--reward_func_timeout" in text
        assert "'abcd'" in text
        assert source.score(["ab"], [""], ["x"]).rewards == [2.0]  # a new thread: not queued behind the hung call
        assert len(set(module["THREADS"])) == 2

        with caplog.at_level(logging.WARNING):
            assert defaulting.score(["a", "b"], ["", ""], ["hang", "x"]).rewards == [-1.0, -1.0]
        assert defaulting.num_defaulted == 2 and "did not return within 0.5 s" in caplog.text
    finally:  # the hung calls return, their threads end
        module["RELEASE"].set()
        defaulting.func.__globals__["RELEASE"].set()


def test_reward_func_timeout_must_be_positive(tmp_path):
    with pytest.raises(UserError, match="--reward_func_timeout must be positive"):
        FunctionReward(raising_file(tmp_path), timeout_s=0)
