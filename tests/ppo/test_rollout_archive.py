"""--rollout_dump_dir / --rollout_replay_dir (openppo/ppo/rollout_archive.py) around a collect function: what is
saved for which step, what a replay returns, where it ends, and the one-line errors. The run that dumps and replays
with real engines is tests/ppo/test_molt_quick_start.py."""

from __future__ import annotations

import pytest
import torch

from openppo.errors import UserError
from openppo.ppo import rollout_archive
from openppo.ppo.collector import Rollout
from openppo.rollout.pool import Sample


def batches(n: int):
    """`n` batches, then None (the prompts ran out)."""
    made = [
        Rollout(
            [Sample([1, 2], [3 + i, 4], [-0.5, -0.25], "stop", group=i, policy_version=i)],
            torch.tensor([0.5 * i]),
            {"reward/x": float(i)},
            [i],
            {"cursor": i + 1},
            {"generate": 1.5},
        )
        for i in range(n)
    ]
    it = iter(made + [None])
    return (lambda: next(it)), made


def test_a_dump_is_replayed_step_for_step_from_where_the_run_resumed(tmp_path, caplog):
    collect, made = batches(2)
    dump = rollout_archive.dumping(collect, str(tmp_path / "d"), first_step=5)  # a run resumed after step 4
    assert [dump(), dump(), dump()] == [*made, None]
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["rollout_step5.pt", "rollout_step6.pt"]
    rollout_archive.check_replay_dir(str(tmp_path / "d"))
    replay = rollout_archive.replaying(str(tmp_path / "d"), first_step=5)
    with caplog.at_level("INFO"):
        first, second, end = replay(), replay(), replay()
    assert end is None and "no " in caplog.text and "rollout_step7.pt, the replay ends" in caplog.text
    for got, want in ((first, made[0]), (second, made[1])):
        assert got.samples == want.samples and torch.equal(got.scores, want.scores)
        assert (got.logs, got.taken, got.stream_state) == (want.logs, want.taken, want.stream_state)
        assert got.timing == {}  # the dumping run's generation time is not this run's
    # a replay that starts later starts at its own step
    assert rollout_archive.replaying(str(tmp_path / "d"), first_step=6)().taken == [1]


def test_what_cannot_be_replayed_says_so_in_one_line(tmp_path):
    with pytest.raises(UserError, match="--rollout_replay_dir .*missing: no such directory"):
        rollout_archive.check_replay_dir(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=r"no rollout_stepN.pt in it; pass the --rollout_dump_dir of an earlier run"):
        rollout_archive.check_replay_dir(str(tmp_path / "empty"))
    torch.save({"not": "a batch"}, tmp_path / "empty" / "rollout_step1.pt")
    with pytest.raises(UserError, match="rollout_step1.pt is not a batch that --rollout_dump_dir saved"):
        rollout_archive.replaying(str(tmp_path / "empty"), 1)()
