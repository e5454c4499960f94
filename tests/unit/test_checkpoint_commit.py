"""Checkpoint commit markers: a resume takes the newest step saved by every part, whatever a crash left behind."""

import json
import logging

import pytest

from openppo.strategy import checkpoint as ckpt

PARTS = ("actor", "critic")


def _part(root, part, step, payload=b"weights"):
    folder = root / part / f"global_step{step}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "mp_rank_00_model_states.pt").write_bytes(payload)
    (root / part / "latest").write_text(f"global_step{step}")  # DeepSpeed rewrites it as soon as its part is done


def _save(root, step, parts=PARTS):
    for part in parts:
        _part(root, part, step)
    ckpt.commit(root, step, list(parts), {"global_step": step, "prompt_stream": {"cursor": 4 * step}})


def test_commit_records_parts_and_state(tmp_path):
    _save(tmp_path, 3)
    commit = ckpt.resolve(tmp_path)
    assert commit == ckpt.Commit(3, PARTS, {"global_step": 3, "prompt_stream": {"cursor": 12}})
    assert commit.tag == "global_step3"
    marker = json.loads((tmp_path / "committed" / "global_step3.json").read_text())
    assert marker["tag"] == "global_step3" and marker["parts"] == list(PARTS)


def test_partial_tag_ignored(tmp_path, caplog):
    """The actor saved step 3 (and DeepSpeed's `latest` names it), the critic had not: resume step 2."""
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    _part(tmp_path, "actor", 3, payload=b"trunc")
    with caplog.at_level(logging.WARNING):
        assert ckpt.resolve(tmp_path).step == 2
    assert "actor/global_step3" in caplog.text
    assert (tmp_path / "actor" / "latest").read_text() == "global_step3"  # not trusted


def test_truncated_marker_ignored(tmp_path, caplog):
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    marker = tmp_path / "committed" / "global_step2.json"
    marker.write_text(marker.read_text()[:20])
    with caplog.at_level(logging.WARNING):
        assert ckpt.resolve(tmp_path).step == 1
    assert "global_step2.json" in caplog.text and "unreadable" in caplog.text


def test_marker_whose_folder_is_gone_ignored(tmp_path):
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    (tmp_path / "critic" / "global_step2" / "mp_rank_00_model_states.pt").unlink()
    (tmp_path / "critic" / "global_step2").rmdir()
    assert ckpt.resolve(tmp_path).step == 1


def test_marker_with_wrong_content_ignored(tmp_path):
    _save(tmp_path, 1)
    _save(tmp_path, 2)
    (tmp_path / "committed" / "global_step2.json").write_text(
        json.dumps({"global_step": 7, "parts": ["actor"], "state": {}})
    )
    assert ckpt.resolve(tmp_path).step == 1


def test_no_commit_is_a_fresh_start(tmp_path):
    """Folders without any marker (the first save was cut short) resume nothing."""
    assert ckpt.resolve(tmp_path / "missing") is None
    for part in PARTS:
        _part(tmp_path, part, 2)
    assert ckpt.resolve(tmp_path) is None


def test_crash_during_marker_write_keeps_previous(tmp_path, monkeypatch):
    _save(tmp_path, 1)
    for part in PARTS:
        _part(tmp_path, part, 2)

    def crash(src, dst):
        raise KeyboardInterrupt  # the process dies between writing the temp file and renaming it

    monkeypatch.setattr(ckpt.os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        ckpt.commit(tmp_path, 2, list(PARTS), {"global_step": 2})
    monkeypatch.undo()
    assert (tmp_path / "committed" / "global_step2.json.tmp").is_file()
    assert ckpt.resolve(tmp_path).step == 1


def test_begin_save_clears_a_partial_save_of_that_step(tmp_path):
    """Resumed at step 2, the next save of step 3 first removes what the crashed save of step 3 left."""
    _save(tmp_path, 2)
    _part(tmp_path, "actor", 3, payload=b"trunc")
    (tmp_path / "actor" / "global_step3" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"x")
    (tmp_path / "committed" / "global_step3.json").write_text("{")
    ckpt.begin_save(tmp_path, 3, list(PARTS))
    assert not (tmp_path / "actor" / "global_step3").exists()
    assert not (tmp_path / "committed" / "global_step3.json").exists()
    assert ckpt.resolve(tmp_path).step == 2
    _save(tmp_path, 3)
    assert ckpt.resolve(tmp_path).step == 3
    assert sorted(p.name for p in (tmp_path / "actor" / "global_step3").iterdir()) == ["mp_rank_00_model_states.pt"]


def test_single_part_layout(tmp_path):
    """The supervised trainers: the tag folders live in the checkpoint folder itself."""
    _save(tmp_path, 4, parts=(ckpt.SINGLE_PART,))
    _part(tmp_path, ckpt.SINGLE_PART, 8)
    assert ckpt.resolve(tmp_path) == ckpt.Commit(4, (".",), {"global_step": 4, "prompt_stream": {"cursor": 16}})
