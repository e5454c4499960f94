"""Checkpoint rotation: keep the newest committed steps, never the one just committed, and clear leftovers."""

from openppo.strategy import checkpoint as ckpt


def _save(root, step, parts=("actor", "critic"), commit=True):
    for part in parts:
        folder = root / part / f"global_step{step}"
        folder.mkdir(parents=True)
        (folder / "mp_rank_00_model_states.pt").write_bytes(b"weights")
    if commit:
        ckpt.commit(root, step, list(parts), {"global_step": step})


def test_rotation_keeps_newest_commits(tmp_path):
    for step in (2, 10, 4, 6):
        _save(tmp_path, step)
    removed = ckpt.rotate(tmp_path, keep=2, current=10, parts=["actor", "critic"])
    assert removed == ["global_step2", "global_step4"]
    for part in ("actor", "critic"):
        assert ckpt.list_tags(tmp_path / part) == ["global_step6", "global_step10"]
    assert [c.step for c in ckpt.list_commits(tmp_path)] == [6, 10]


def test_rotation_never_removes_the_current_commit(tmp_path):
    """A fresh run (no --load_checkpoint) re-using a folder: its first commit is the one to keep, not the earlier
    run's later steps, which would otherwise win the next resume."""
    for step in (6, 8):
        _save(tmp_path, step)  # an earlier run
    _save(tmp_path, 2)
    removed = ckpt.rotate(tmp_path, keep=1, current=2, parts=["actor", "critic"])
    assert removed == ["global_step6", "global_step8"]
    assert ckpt.resolve(tmp_path).step == 2
    assert ckpt.list_tags(tmp_path / "actor") == ["global_step2"]


def test_rotation_clears_uncommitted_folders_and_temp_markers(tmp_path):
    _save(tmp_path, 1)
    _save(tmp_path, 2, parts=("actor",), commit=False)  # a save cut short after the actor's part
    _save(tmp_path, 3)
    (tmp_path / "committed" / "global_step4.json.tmp").write_text("{")
    removed = ckpt.rotate(tmp_path, keep=3, current=3, parts=["actor", "critic"])
    assert removed == ["global_step2"]
    assert ckpt.list_tags(tmp_path / "actor") == ["global_step1", "global_step3"]
    assert sorted(p.name for p in (tmp_path / "committed").iterdir()) == ["global_step1.json", "global_step3.json"]


def test_rotation_single_part_layout_keeps_other_files(tmp_path):
    """The supervised trainers' layout: tags in the folder itself beside DeepSpeed's `latest` and HF exports."""
    for step in (4, 8, 12):
        _save(tmp_path, step, parts=(ckpt.SINGLE_PART,))
    (tmp_path / "global_step4_hf").mkdir()
    (tmp_path / "latest").write_text("global_step12")
    assert ckpt.rotate(tmp_path, keep=2, current=12, parts=[ckpt.SINGLE_PART]) == ["global_step4"]
    assert ckpt.list_tags(tmp_path) == ["global_step8", "global_step12"]
    assert (tmp_path / "global_step4_hf").is_dir() and (tmp_path / "latest").is_file()


def test_hf_exports_rotate_with_the_newest_kept(tmp_path):
    for step in (2, 10, 4):
        (ckpt.hf_export_dir(tmp_path, step)).mkdir()
    (tmp_path / "global_step3").mkdir()  # a checkpoint tag, not an export: not touched
    assert ckpt.rotate_hf(tmp_path, keep=2) == ["global_step2_hf"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step10_hf", "global_step3", "global_step4_hf"]
    assert ckpt.rotate_hf(tmp_path, keep=0) == []


def test_max_ckpt_mem_keeps_the_newest_that_fit(tmp_path):
    """--max_ckpt_mem: of the steps --max_ckpt_num keeps, only the newest that fit together stay; the one just
    committed stays even alone over the limit. Each step here is 2 parts x 7 bytes = 14 bytes."""
    for step in (1, 2, 3, 4):
        _save(tmp_path, step)
    removed = ckpt.rotate(tmp_path, keep=0, current=4, parts=["actor", "critic"], max_bytes=30)
    assert removed == ["global_step1", "global_step2"]  # 4 and 3 fit in 30 bytes (28), 2 would make 42
    assert [c.step for c in ckpt.list_commits(tmp_path)] == [3, 4]
    assert ckpt.rotate(tmp_path, keep=0, current=4, parts=["actor", "critic"], max_bytes=1) == ["global_step3"]
    assert ckpt.list_tags(tmp_path / "actor") == ["global_step4"]


def test_max_ckpt_mem_is_in_gib():
    from openppo.config.common import CheckpointConfig

    assert ckpt.max_bytes(CheckpointConfig()) is None
    assert ckpt.max_bytes(CheckpointConfig(max_ckpt_mem=1.5)) == 1.5 * 2**30
