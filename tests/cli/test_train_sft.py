"""train_sft end to end: 2 ranks, ZeRO-3, real DeepSpeed on CPU, a tiny model on the (cut) Qwen3 tokenizer."""

from __future__ import annotations

import pytest
import torch

from tests.cli.data import sft_rows
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
        "--input_key",
        "input",
        "--output_key",
        "output",
        "--apply_chat_template",
        "--max_len",
        "64",
        "--train_batch_size",
        "8",
        "--micro_train_batch_size",
        "2",
        "--max_epochs",
        "6",
        "--learning_rate",
        "5e-3",
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
        "--seed",
        "7",
        *extra,
    ]


@pytest.fixture(scope="module")
def sft_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sft")
    data = write_jsonl(tmp / "sft.jsonl", sft_rows(32))
    model = tiny_model_dir()
    save = tmp / "out"
    proc = run_cli("train_sft", _args(model, data, save, ["--save_steps", "4", "--max_ckpt_num", "3"]))
    return tmp, data, model, save, proc


def test_sft_loss_falls_by_half(sft_run):
    *_, save, _ = sft_run
    losses = [v for _, v in series(read_metrics(save), "train/loss")]
    assert len(losses) == 24  # 32 samples / 8 per step x 6 epochs
    assert losses[-1] < 0.5 * losses[0], losses


def test_sft_writes_run_info_and_checkpoints(sft_run):
    *_, save, proc = sft_run
    info = (save / "run_info.json").read_text()
    assert '"git_revision"' in info and '"deepspeed"' in info and '"zero_stage": 3' in info
    tags = sorted(p.name for p in (save / "checkpoints").iterdir() if p.name.startswith("global_step"))
    assert tags == ["global_step16", "global_step20", "global_step24"]  # rotated to --max_ckpt_num 3


def test_sft_saved_folder_reproduces_eval_loss(sft_run):
    """The exported HF folder gives the same eval loss the trainer logged for its final weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from openppo.datasets import SFTDataset, collate_padded, load_blended_dataset

    _, data, _, save, _ = sft_run
    logged = series(read_metrics(save), "eval/loss")[-1][1]
    tok = AutoTokenizer.from_pretrained(save)
    model = AutoModelForCausalLM.from_pretrained(save, dtype=torch.float32).eval()
    ds = SFTDataset(
        load_blended_dataset(str(data)),
        tok,
        max_len=64,
        input_key="input",
        output_key="output",
        apply_chat_template=True,
        input_template=None,
    )
    total = 0.0
    batches = 0
    # the trainer's batches: rank r of 2 takes rows r, r + 2, ... in micro-batches of 2; the mean of per-batch means
    pairs = [rows[i : i + 2] for r in (0, 1) for rows in [list(range(r, len(ds), 2))] for i in range(0, len(rows), 2)]
    with torch.no_grad():
        for pair in pairs:
            batch = collate_padded([ds[j] for j in pair], pad_token_id=tok.pad_token_id)
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
            lp = torch.log_softmax(logits.float(), -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
            mask = batch["loss_mask"][:, 1:].float()
            total += (-(lp * mask).sum() / mask.sum()).item()
            batches += 1
    assert total / batches == pytest.approx(logged, rel=1e-4, abs=1e-4)


def test_sft_resume_continues_at_same_step(sft_run):
    """Resume from the step-16 checkpoint: steps 17.. match the unbroken run. The resumed run also keeps one
    resumable checkpoint while counting three HF exports, and exports no final model (Molt's spellings)."""
    tmp, data, model, save, _ = sft_run
    ckpt = checkpoint_copy(save, 16, tmp / "resume_ckpt")
    resumed = tmp / "resumed"
    keep = ["--save_steps", "4", "--save_hf_ckpt", "--ckpt.max_num", "3", "--ckpt.dcp_max_num", "1"]
    extra = ["--ckpt_path", str(ckpt), "--load_checkpoint", *keep, "--ckpt.disable_final_save"]
    proc = run_cli("train_sft", _args(model, data, resumed, extra))
    assert "resumed from" in proc.stdout + proc.stderr
    assert_resumed_like_unbroken(save, resumed, "train/loss", 17, 24)
    kept = sorted(p.name for p in ckpt.iterdir() if p.name.startswith("global_step"))
    assert kept == ["global_step20_hf", "global_step24", "global_step24_hf"], kept
    assert (resumed / "metrics.jsonl").is_file() and not (resumed / "config.json").exists()
    assert "--disable_final_save: the trained model is not exported" in proc.stdout + proc.stderr
