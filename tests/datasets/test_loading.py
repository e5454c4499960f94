"""load_blended_dataset / require_columns on real files of every supported kind."""

import json

import datasets
import pytest

from openppo.datasets import load_blended_dataset, require_columns
from openppo.errors import UserError

ROWS = [{"prompt": f"q{i}", "answer": str(i)} for i in range(4)]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("kind", ["json_list", "jsonl", "json_lines_in_json", "parquet", "csv"])
def test_each_file_kind_loads(tmp_path, kind):
    ds0 = datasets.Dataset.from_list(ROWS)
    if kind == "json_list":
        path = tmp_path / "d.json"
        path.write_text(json.dumps(ROWS))
    elif kind == "jsonl":
        path = tmp_path / "d.jsonl"
        write_jsonl(path, ROWS)
    elif kind == "json_lines_in_json":
        path = tmp_path / "d.json"
        write_jsonl(path, ROWS)
    elif kind == "parquet":
        path = tmp_path / "d.parquet"
        ds0.to_parquet(str(path))
    else:
        path = tmp_path / "d.csv"
        ds0.to_csv(str(path), index=False)
    ds = load_blended_dataset(str(path))
    assert ds.column_names == ["prompt", "answer"]
    assert ds["prompt"] == ["q0", "q1", "q2", "q3"]
    # csv cannot tell "0" from 0: values are compared as text
    assert [str(a) for a in ds["answer"]] == ["0", "1", "2", "3"]


def test_save_to_disk_dataset_and_dict_split(tmp_path):
    datasets.Dataset.from_list(ROWS).save_to_disk(str(tmp_path / "single"))
    assert load_blended_dataset(str(tmp_path / "single"))["prompt"] == ["q0", "q1", "q2", "q3"]

    dd = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS[:3]), "test": datasets.Dataset.from_list(ROWS[3:])}
    )
    dd.save_to_disk(str(tmp_path / "dict"))
    assert len(load_blended_dataset(str(tmp_path / "dict"))) == 3
    assert load_blended_dataset(str(tmp_path / "dict"), split="test")["prompt"] == ["q3"]
    with pytest.raises(UserError, match=r"--eval_dataset: .*no split 'dev' \(splits: train, test\)"):
        load_blended_dataset(str(tmp_path / "dict"), flag="--eval_dataset", split="dev")


def test_folder_of_data_files(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", ROWS[:2])
    write_jsonl(tmp_path / "b.jsonl", ROWS[2:])
    assert sorted(load_blended_dataset(str(tmp_path))["prompt"]) == ["q0", "q1", "q2", "q3"]


def test_two_sources_without_probs_are_concatenated(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"x": "a0"}, {"x": "a1"}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"x": "b0"}])
    assert load_blended_dataset(f"{a}, {b}")["x"] == ["a0", "a1", "b0"]


def test_probs_one_zero_keeps_only_the_first_source(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"x": f"a{i}"} for i in range(5)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"x": f"b{i}"} for i in range(5)])
    assert load_blended_dataset(f"{a},{b}", "1,0")["x"] == [f"a{i}" for i in range(5)]


def test_probs_half_half_takes_every_row_of_both(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"x": f"a{i}"} for i in range(6)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"x": f"b{i}"} for i in range(3)])
    mixed = load_blended_dataset(f"{a},{b}", "0.5,0.5", seed=3)["x"]
    # all_exhausted: every row of both sources appears; the smaller source is repeated to keep the 50/50 mix
    assert set(mixed) == {f"a{i}" for i in range(6)} | {f"b{i}" for i in range(3)}
    assert len(mixed) >= 9
    assert mixed == load_blended_dataset(f"{a},{b}", "0.5,0.5", seed=3)["x"]  # same seed, same order


def test_sources_with_different_columns_keep_the_common_ones(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"prompt": "p", "answer": "1", "extra": 5}])
    b = write_jsonl(tmp_path / "b.jsonl", [{"answer": "2", "prompt": "q"}])
    ds = load_blended_dataset(f"{a},{b}")
    assert ds.column_names == ["prompt", "answer"]
    assert ds["prompt"] == ["p", "q"]


def test_max_samples_truncates_after_mixing(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", ROWS)
    b = write_jsonl(tmp_path / "b.jsonl", ROWS)
    assert len(load_blended_dataset(f"{a},{b}", max_samples=5)) == 5
    assert len(load_blended_dataset(a, max_samples=100)) == 4


def test_missing_file_names_the_flag(tmp_path):
    with pytest.raises(UserError, match=r"^--prompt_data: '.*nope\.jsonl' not found; pass a local"):
        load_blended_dataset(str(tmp_path / "nope.jsonl"), flag="--prompt_data")
    with pytest.raises(UserError, match="--dataset: 'Anthropic/hh-rlhf' not found"):
        load_blended_dataset("Anthropic/hh-rlhf")


def test_empty_sources_name_the_flag(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(UserError, match="--dataset: .*empty.jsonl' is empty"):
        load_blended_dataset(str(tmp_path / "empty.jsonl"))
    datasets.Dataset.from_dict({"prompt": []}).to_parquet(str(tmp_path / "none.parquet"))
    with pytest.raises(UserError, match="--eval_dataset: .*none.parquet' has no rows"):
        load_blended_dataset(str(tmp_path / "none.parquet"), flag="--eval_dataset")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(UserError, match="--dataset: cannot read .*bad.json"):
        load_blended_dataset(str(tmp_path / "bad.json"))


def test_bad_probs_name_the_probs_flag(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", ROWS)
    b = write_jsonl(tmp_path / "b.jsonl", ROWS)
    with pytest.raises(UserError, match="--dataset_probs: got 1 probabilities for 2 --dataset sources"):
        load_blended_dataset(f"{a},{b}", "1")
    with pytest.raises(UserError, match="--prompt_probs: .*non-negative"):
        load_blended_dataset(f"{a},{b}", "-1,2", probs_flag="--prompt_probs")
    with pytest.raises(UserError, match="--dataset_probs: .*non-negative"):
        load_blended_dataset(f"{a},{b}", "0,0")
    with pytest.raises(UserError, match="--dataset_probs: 'a,b' is not a comma list of numbers"):
        load_blended_dataset(f"{a},{b}", "a,b")


def test_require_columns_lists_the_columns():
    ds = datasets.Dataset.from_list(ROWS)
    require_columns(ds, {"--input_key": "prompt", "--label_key": None}, "data/train.jsonl")
    expected = (
        "--input_key: column 'question' not found in data/train.jsonl (columns: prompt, answer); "
        "pass --input_key with one of those"
    )
    with pytest.raises(UserError) as err:
        require_columns(ds, {"--input_key": "question"}, "data/train.jsonl")
    assert str(err.value) == expected


def test_loading_writes_nothing_to_stderr(tmp_path, capfd):
    # bad-input runs must print exactly one error line, so `datasets` progress bars stay off while loading
    a = write_jsonl(tmp_path / "a.jsonl", ROWS)
    b = write_jsonl(tmp_path / "b.jsonl", [{"prompt": "x", "answer": 1.5}])  # cast to a's types when mixing
    load_blended_dataset(f"{a},{b}", "1,1")
    assert capfd.readouterr().err == ""
    assert not datasets.are_progress_bars_disabled()  # and are back on afterwards


def test_split_flags_pick_each_clis_split(tmp_path):
    """--prompt_split / --dataset_split / --eval_split (OpenRLHF's --data.prompt_split, ...) reach the loader."""
    from openppo.config.schema import parse_config
    from openppo.ppo.config import PPOConfig
    from openppo.ppo.launch import load_prompt_rows
    from openppo.trainers.configs import SFTConfig
    from openppo.trainers.setup import load_raw_data

    folder = str(tmp_path / "dict")
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(ROWS[:3]), "test": datasets.Dataset.from_list(ROWS[3:])}
    ).save_to_disk(folder)
    ppo = parse_config(
        PPOConfig,
        f"--prompt_data {folder} --prompt_split test --eval_dataset {folder} --input_key prompt".split(),
        "train_ppo_ray",
    )
    assert load_prompt_rows(ppo)["prompt"] == ["q3"] and len(load_prompt_rows(ppo, eval=True)) == 3
    sft = parse_config(
        SFTConfig, f"--data.dataset {folder} --data.dataset_split test --eval.dataset {folder}".split(), "train_sft"
    )
    train, evaluation = load_raw_data(sft.data, {"--input_key": "prompt"}, seed=0)
    assert train["prompt"] == ["q3"] and len(evaluation) == 3
    sft.data.eval_split = "dev"
    with pytest.raises(UserError, match=r"--eval_dataset: .*no split 'dev' .*pass --eval_split with one of those"):
        load_raw_data(sft.data, {"--input_key": "prompt"}, seed=0)
