"""Checkpoint folder bookkeeping."""

from openppo.strategy import checkpoint as ckpt


def _make(tmp_path, steps, latest):
    for s in steps:
        (tmp_path / f"global_step{s}").mkdir()
    (tmp_path / "latest").write_text(f"global_step{latest}")


def test_rotation_keeps_newest(tmp_path):
    _make(tmp_path, [2, 10, 4, 6], latest=10)
    removed = ckpt.rotate(tmp_path, keep=2)
    assert removed == ["global_step2", "global_step4"]
    assert ckpt.list_tags(tmp_path) == ["global_step6", "global_step10"]


def test_rotation_never_removes_latest(tmp_path):
    _make(tmp_path, [2, 4, 6], latest=2)
    ckpt.rotate(tmp_path, keep=1)
    assert "global_step2" in ckpt.list_tags(tmp_path)


def test_latest_tag_requires_folder(tmp_path):
    (tmp_path / "latest").write_text("global_step8")
    assert ckpt.latest_tag(tmp_path) is None
    (tmp_path / "global_step8").mkdir()
    assert ckpt.latest_tag(tmp_path) == "global_step8"
