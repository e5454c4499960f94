"""train_dpo end to end: 2 ranks, ZeRO-3 policy + ZeRO-3 reference; the reward margin rises."""

from __future__ import annotations

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
        "3",
        "--learning_rate",
        "5e-4",
        "--lr_warmup_ratio",
        "0",
        "--lr_scheduler",
        "constant",
        "--zero_stage",
        "3",
        "--param_dtype",
        "fp32",
        "--beta",
        "0.1",
        "--nll_loss_coef",
        "0.1",
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
def dpo_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dpo")
    data = write_jsonl(tmp / "pairs.jsonl", preference_rows(32))
    model = tiny_model_dir()
    save = tmp / "out"
    run_cli("train_dpo", _args(model, data, save, ["--use_tensorboard", str(tmp / "tb"), "--use_wandb", "offline"]))
    return tmp, data, model, save


def test_dpo_reward_margin_rises(dpo_run):
    *_, save = dpo_run
    records = read_metrics(save)
    margins = [v for _, v in series(records, "train/margin")]
    assert len(margins) == 12
    assert margins[-1] > margins[0] and margins[-1] > 0
    assert series(records, "eval/margin")[-1][1] > 0
    assert series(records, "train/nll_loss")  # the optional NLL term is logged when on


def test_dpo_logs_to_tensorboard_and_wandb_offline(dpo_run):
    tmp, *_, save = dpo_run
    assert list((tmp / "tb").rglob("events.out.tfevents.*"))
    assert list(save.rglob("offline-run-*"))


def test_dpo_saved_folder_reproduces_margin(dpo_run):
    """Policy reloaded from its folder + the original reference give the logged eval reward margin."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from openppo.datasets import PreferenceDataset, collate_pairs, load_blended_dataset

    _, data, model_dir, save = dpo_run
    logged = series(read_metrics(save), "eval/margin")[-1][1]
    tok = AutoTokenizer.from_pretrained(save)
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

    def seq_logps(path):
        m = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        out = []
        with torch.no_grad():
            for i in range(0, len(ds), 2):
                b = collate_pairs([ds[j] for j in range(i, i + 2)], pad_token_id=tok.pad_token_id)
                logits = m(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, :-1]
                lp = torch.log_softmax(logits, -1).gather(-1, b["input_ids"][:, 1:, None]).squeeze(-1)
                s = (lp * b["loss_mask"][:, 1:]).sum(-1)
                out.append((s[:2], s[2:]))
        return out

    margins = []
    for (pc, pr), (rc, rr) in zip(seq_logps(save), seq_logps(model_dir)):
        margins.append((0.1 * ((pc - rc) - (pr - rr))).mean().item())
    assert sum(margins) / len(margins) == pytest.approx(logged, rel=1e-3, abs=1e-4)


def test_dpo_resume_continues_at_same_step(dpo_run):
    tmp, data, model, save = dpo_run
    ckpt = checkpoint_copy(save, 8, tmp / "resume_ckpt")
    resumed = tmp / "resumed"
    run_cli("train_dpo", _args(model, data, resumed, ["--ckpt_path", str(ckpt), "--load_checkpoint"]))
    assert_resumed_like_unbroken(save, resumed, "train/loss", 9, 12)
