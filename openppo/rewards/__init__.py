"""Reward sources other than an in-trainer reward model: a user's Python function or HTTP reward servers.

`build_reward_source(--remote_rm_url value)` picks one; each returns a `RewardResult` per batch of texts.
"""

from __future__ import annotations

from urllib.parse import urlsplit

from openppo.errors import UserError
from openppo.rewards.base import RewardError, RewardResult, RewardSource
from openppo.rewards.function import FLAG, FunctionReward
from openppo.rewards.remote import RemoteReward

__all__ = ["FunctionReward", "RemoteReward", "RewardError", "RewardResult", "RewardSource", "build_reward_source"]

ACCEPTED = (
    "a .py file defining reward_func(queries, prompts, labels, **kwargs), or a comma list of "
    "http(s) endpoints such as http://127.0.0.1:5000/get_reward (python -m openppo.cli.serve_rm)"
)


def parse_urls(value: str, flag: str = FLAG) -> list[str]:
    """The http(s) URLs of a comma list; UserError naming `flag` for an empty or malformed entry."""
    urls = [part.strip() for part in value.split(",")]
    for url in urls:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UserError(f"{flag}: {url!r} is not an http(s) URL with a host; pass {ACCEPTED}")
        try:
            parts.port  # noqa: B018 - raises ValueError on a port like :abc or :99999
        except ValueError as err:
            raise UserError(f"{flag}: {url!r} has a bad port ({err})") from err
    return urls


def build_reward_source(
    remote_rm_url: str | None,
    *,
    default_reward: float | None = None,
    timeout_s: float = 60.0,
    max_retries: int = 3,
    backoff_s: float = 1.0,
    batch_size: int = 64,
    func_timeout_s: float = 600.0,
) -> RewardSource | None:
    """None when no URL is given (the trainer then scores with --reward_pretrain), else the reward source.

    `default_reward`: reward used for a batch (function) or chunk (server) whose source fails; None = raise.
    `func_timeout_s` bounds a .py file's calls; the other arguments configure `RemoteReward`.
    """
    if remote_rm_url is None:
        return None
    value = remote_rm_url.strip()
    if not value:
        raise UserError(f"{FLAG} is empty; pass {ACCEPTED}, or leave it out to use --reward_pretrain")
    if value.lower().startswith(("http://", "https://")):
        if timeout_s <= 0 or max_retries < 0 or batch_size < 1:
            raise UserError(
                f"--remote_rm_timeout must be > 0 and --remote_rm_retries >= 0 (and the batch size >= 1); "
                f"got {timeout_s}, {max_retries}, {batch_size}"
            )
        return RemoteReward(
            parse_urls(value),
            timeout_s=timeout_s,
            max_retries=max_retries,
            backoff_s=backoff_s,
            batch_size=batch_size,
            default_reward=default_reward,
        )
    if value.endswith(".py"):
        if "," in value:
            raise UserError(f"{FLAG}: {value!r} looks like several files; pass a single .py file")
        return FunctionReward(value, default_reward=default_reward, timeout_s=func_timeout_s)
    raise UserError(f"{FLAG}: cannot use {value!r}; pass {ACCEPTED}")
