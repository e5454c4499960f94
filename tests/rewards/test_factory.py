"""build_reward_source: each accepted --remote_rm_url form, and the errors for the others."""

from __future__ import annotations

import pytest

from openppo.errors import UserError
from openppo.rewards import FunctionReward, RemoteReward, build_reward_source
from tests.rewards.conftest import EXAMPLES


def test_none_means_reward_model():
    assert build_reward_source(None) is None


def test_py_file_gives_function_reward():
    source = build_reward_source(str(EXAMPLES / "target_token.py"), default_reward=0.0)
    assert isinstance(source, FunctionReward) and source.default_reward == 0.0


def test_url_list_gives_remote_reward():
    source = build_reward_source(
        " http://127.0.0.1:5000/get_reward, https://localhost/rm ", timeout_s=5, max_retries=1, batch_size=8
    )
    assert isinstance(source, RemoteReward)
    assert source.urls == ["http://127.0.0.1:5000/get_reward", "https://localhost/rm"]
    assert (source.timeout_s, source.max_retries, source.batch_size) == (5.0, 1, 8)
    source.close()


@pytest.mark.parametrize(
    "value, match",
    [
        ("", "is empty"),
        ("models/rm", "cannot use 'models/rm'"),
        ("ftp://host/rm", "cannot use"),
        ("127.0.0.1:5000/get_reward", "cannot use"),
        ("http://", "not an http"),
        ("http://127.0.0.1:5000/get_reward,", "'' is not an http"),
        ("http://127.0.0.1:5000/x,reward.py", "'reward.py' is not an http"),
        ("http://127.0.0.1:99999/x", "bad port"),
        ("a.py,b.py", "single .py file"),
        ("missing_file.py", "not found"),
    ],
)
def test_rejected_values_name_the_flag(value, match):
    with pytest.raises(UserError, match=match) as info:
        build_reward_source(value)
    assert "--remote_rm_url" in str(info.value)


def test_bad_remote_settings():
    with pytest.raises(UserError, match="--remote_rm_timeout must be > 0"):
        build_reward_source("http://127.0.0.1:5000/get_reward", timeout_s=0)
