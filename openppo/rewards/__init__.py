"""Reward sources other than an in-trainer reward model: a user's Python function or HTTP reward servers.

`build_reward_source(--remote_rm_url value)` picks one; each returns a `RewardResult` per batch of texts.
"""

from openppo.rewards.base import RewardError, RewardResult, RewardSource
from openppo.rewards.factory import build_reward_source
from openppo.rewards.function import FunctionReward
from openppo.rewards.remote import RemoteReward

__all__ = ["FunctionReward", "RemoteReward", "RewardError", "RewardResult", "RewardSource", "build_reward_source"]
