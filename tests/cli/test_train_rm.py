"""train_rm end to end: 2 ranks, ZeRO-3, a tiny model learns a separable preference set."""

from __future__ import annotations

import json

import pytest
import torch

from tests.cli.data import preference_rows
from tests.cli.helpers import assert_resumed_like_unbroken, checkpoint_copy, read_metrics, run_cli, series, write_jsonl
from tests.model_cache import tiny_model_dir

pytestmark = pytest.mark.slow


def _args(model, data, save, extra=()):
    return [
        "--pretrain",
        str(model),
        "--dataset",
        str(data),
        "--eval_dataset",
        str(data),
        "--prompt_key",
        "prompt",
        "--chosen_key",
        "chosen",
        "--rejected_key",
        "rejected",
        "--apply_chat_template",
        "--max_len",
        "64",
        "--train_batch_size",
        "8",
        "--micro_train_batch_size",
        "2",
        "--max_epochs",
        "5",
        "--learning_rate",
        "1e-3",
        "--lr_warmup_ratio",
        "0",
        "--lr_scheduler",
        "constant",
        "--zero_stage",
        "3",
        "--param_dtype",
        "fp32",
        "--save_path",
        str(save),
        "--save_steps",
        "4",
        "--max_ckpt_num",
        "10",
        "--ds.packing_samples",  # every run packs its micro-batches (OpenRLHF >= 0.10's spelling)
        *extra,
    ]


@pytest.fixture(scope="module")
def rm_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rm")
    data = write_jsonl(tmp / "pairs.jsonl", preference_rows(32))
    model = tiny_model_dir()
    save = tmp / "out"
    run_cli("train_rm", _args(model, data, save))
    return tmp, data, model, save


def test_rm_learns_separable_set(rm_run):
    *_, save = rm_run
    records = read_metrics(save)
    assert series(records, "eval/acc")[-1][1] > 0.9
    losses = [v for _, v in series(records, "train/loss")]
    assert losses[-1] < losses[0]


def test_rm_saved_folder_reproduces_scores(rm_run):
    """Reloaded from its HF folder, the model gives the logged eval accuracy and reward means."""
    from transformers import AutoTokenizer

    from openppo.datasets import PreferenceDataset, collate_pairs, load_blended_dataset
    from openppo.models.scalar import ScalarModel

    _, data, _, save = rm_run
    config = json.loads((save / "config.json").read_text())
    assert config["architectures"][0].endswith("ForSequenceClassification")
    assert config["value_std"] > 0 and "value_mean" in config
    logged = {k: series(read_metrics(save), k)[-1][1] for k in ("eval/acc", "eval/chosen_reward")}
    tok = AutoTokenizer.from_pretrained(save)
    model = ScalarModel.from_pretrained(str(save), dtype=torch.float32, flag="--pretrain").eval()
    ds = PreferenceDataset(
        load_blended_dataset(str(data)),
        tok,
        max_len=64,
        prompt_key="prompt",
        chosen_key="chosen",
        rejected_key="rejected",
        apply_chat_template=True,
        input_template=None,
    )
    batch = collate_pairs([ds[i] for i in range(len(ds))], pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        scores = model.score_last(batch["input_ids"], batch["attention_mask"])
    chosen, rejected = scores[: len(ds)], scores[len(ds) :]
    assert (chosen > rejected).float().mean().item() == pytest.approx(logged["eval/acc"], abs=1e-6)
    assert chosen.mean().item() == pytest.approx(logged["eval/chosen_reward"], rel=1e-4, abs=1e-4)


def test_rm_resume_continues_at_same_step(rm_run):
    tmp, data, model, save = rm_run
    ckpt = checkpoint_copy(save, 16, tmp / "resume_ckpt")
    resumed = tmp / "resumed"
    run_cli("train_rm", _args(model, data, resumed, ["--ckpt_path", str(ckpt), "--load_checkpoint"]))
    assert_resumed_like_unbroken(save, resumed, "train/loss", 17, 20)
