"""LoRA SFT (adapter export + lora_combiner merge) and packed SFT, both 2 ranks on real DeepSpeed."""

from __future__ import annotations

import pytest
import torch

from tests.cli.data import sft_rows
from tests.cli.helpers import read_metrics, run_cli, series, write_jsonl
from tests.model_cache import tiny_model_dir

pytestmark = pytest.mark.slow


def _args(model, data, save, extra=()):
    return [
        "--pretrain",
        str(model),
        "--dataset",
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
        "3",
        "--learning_rate",
        "2e-3",
        "--lr_warmup_ratio",
        "0",
        "--lr_scheduler",
        "constant",
        "--param_dtype",
        "fp32",
        "--save_path",
        str(save),
        *extra,
    ]


def _eval_loss(model, tok, data) -> float:
    from openppo.datasets import SFTDataset, collate_padded, load_blended_dataset

    ds = SFTDataset(
        load_blended_dataset(str(data)),
        tok,
        max_len=64,
        input_key="input",
        output_key="output",
        apply_chat_template=True,
        input_template=None,
    )
    batch = collate_padded([ds[i] for i in range(len(ds))], pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
    lp = torch.log_softmax(logits.float(), -1).gather(-1, batch["input_ids"][:, 1:, None]).squeeze(-1)
    mask = batch["loss_mask"][:, 1:].float()
    return (-(lp * mask).sum() / mask.sum()).item()


def test_lora_sft_adapter_and_merge(tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = write_jsonl(tmp_path / "sft.jsonl", sft_rows(16))
    model_dir = tiny_model_dir()
    save = tmp_path / "lora"
    run_cli(
        "train_sft",
        _args(
            model_dir,
            data,
            save,
            [
                "--lora_rank",
                "8",
                "--lora_alpha",
                "16",
                "--zero_stage",
                "2",
                "--learning_rate",
                "5e-3",
                "--param_dtype",
                "auto",
            ],
        ),
    )
    assert (save / "adapter_config.json").is_file() and (save / "adapter_model.safetensors").is_file()
    losses = [v for _, v in series(read_metrics(save), "train/loss")]
    assert losses[-1] < losses[0]
    merged = tmp_path / "merged"
    run_cli(
        "lora_combiner",
        [
            "--model_path",
            str(model_dir),
            "--lora_path",
            str(save),
            "--output_path",
            str(merged),
            "--param_dtype",
            "fp32",
        ],
        nproc=1,
    )
    tok = AutoTokenizer.from_pretrained(merged)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with_adapter = PeftModel.from_pretrained(base, save).eval()
    merged_model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    adapted_loss = _eval_loss(with_adapter, tok, data)
    assert _eval_loss(merged_model, tok, data) == pytest.approx(adapted_loss, rel=1e-4)
    assert adapted_loss < _eval_loss(plain, tok, data)  # the adapter learned something


def test_packed_sft_learns_and_matches_padded_loss(tmp_path):
    """Packed rows train as well as padded ones: same first-step loss (same weights, same data), falling loss."""
    data = write_jsonl(tmp_path / "sft.jsonl", sft_rows(32))
    model_dir = tiny_model_dir()
    packed, padded = tmp_path / "packed", tmp_path / "padded"
    run_cli(
        "train_sft",
        _args(
            model_dir,
            data,
            packed,
            ["--packing_samples", "--zero_stage", "3", "--learning_rate", "5e-3", "--max_epochs", "4"],
        ),
    )
    # The padded run also turns on checkpointing, optimizer offload, comm overlap and the LM head in chunks (of 7
    # positions, ZeRO-3 on 2 ranks): none may change the math.
    run_cli(
        "train_sft",
        _args(
            model_dir,
            data,
            padded,
            ["--zero_stage", "3", "--max_epochs", "1", "--gradient_checkpointing", "--adam_offload", "--overlap_comm"]
            + ["--lm_head_chunk_tokens", "7"],
        ),
    )
    packed_losses = [v for _, v in series(read_metrics(packed), "train/loss")]
    padded_losses = [v for _, v in series(read_metrics(padded), "train/loss")]
    assert packed_losses[-1] < 0.7 * packed_losses[0]
    # Step 1 runs on the initial weights in both: the token-mean per micro-batch is identical packed or padded.
    assert packed_losses[0] == pytest.approx(padded_losses[0], rel=1e-4)
