"""train_sft on image samples end to end (Molt's `--data.image_key`, `--data.max_images_per_prompt`,
`--model.freeze_visual_encoder`): 2 ranks, ZeRO-2, real DeepSpeed on CPU, the tiny Idefics3 VLM in fp32, the
built-in shapes task's pictures with their counts as the responses, and one row whose image file is missing.

- the bad row is skipped and counted, in the training and the eval set;
- the loss falls;
- the vision tower does not move, every language-model tensor does;
- the exported folder (with its processor) gives the eval loss the trainer logged, computed independently: the
  processor expands each prompt with its picture, transformers' model scores the response tokens.
"""

from __future__ import annotations

import pytest
import torch

from openppo.tasks.arithmetic import write_jsonl
from openppo.tasks.shapes import make_rows
from tests.cli.helpers import read_metrics, run_cli, series
from tests.model_cache import tiny_vlm_dir

pytestmark = pytest.mark.slow

ROWS = 16


@pytest.fixture(scope="module")
def image_sft(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("sft_images")
    rows = [{**row, "output": row["label"]} for row in make_rows(ROWS, seed=3)]
    rows.append({**rows[0], "images": [str(tmp / "missing.png")]})
    data = write_jsonl(rows, tmp / "shapes.jsonl")
    save = tmp / "out"
    args = ["--pretrain", str(tiny_vlm_dir()), "--dataset", str(data), "--eval_dataset", str(data)]
    args += ["--input_key", "prompt", "--output_key", "output", "--apply_chat_template", "--max_len", "64"]
    args += ["--data.image_key", "images", "--data.max_images_per_prompt", "1", "--model.freeze_visual_encoder"]
    args += ["--train_batch_size", "8", "--micro_train_batch_size", "2", "--max_epochs", "2", "--seed", "7"]
    args += ["--learning_rate", "1e-3", "--lr_warmup_ratio", "0", "--lr_scheduler", "constant"]
    args += ["--zero_stage", "2", "--param_dtype", "fp32", "--save_path", str(save)]
    proc = run_cli("train_sft", args)
    return data, save, proc.stdout + proc.stderr


def test_bad_image_rows_are_skipped_and_counted(image_sft):
    *_, log = image_sft
    assert f"SFT data: skipping row {ROWS}: " in log and "missing.png" in log
    assert log.count(f"SFT data: skipped 1 of {ROWS + 1} samples with bad images (--image_key images)") >= 2


def test_loss_falls_and_only_the_language_model_moves(image_sft):
    from safetensors.torch import load_file

    _, save, _ = image_sft
    losses = [v for _, v in series(read_metrics(save), "train/loss")]
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.5, losses
    start, end = load_file(tiny_vlm_dir() / "model.safetensors"), load_file(save / "model.safetensors")
    assert start.keys() == end.keys()
    language = [n for n in start if ".text_model." in n]
    tower = [n for n in start if n not in language]
    assert len(tower) > 10 and len(language) > 10
    assert all(torch.equal(start[n], end[n]) for n in tower)
    assert [n for n in language if torch.equal(start[n], end[n])] == []


def test_exported_folder_gives_the_logged_eval_loss(image_sft):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from openppo.datasets import load_blended_dataset
    from openppo.utils.images import open_image

    data, save, _ = image_sft
    logged = series(read_metrics(save), "eval/loss")[-1][1]
    processor = AutoProcessor.from_pretrained(save)
    model = AutoModelForImageTextToText.from_pretrained(save, dtype=torch.float32).eval()
    tok = processor.tokenizer
    losses = []
    with torch.no_grad():
        for row in list(load_blended_dataset(str(data)))[:ROWS]:
            prompt = tok.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
            inputs = processor(text=[prompt], images=[[open_image(row["images"][0])]], return_tensors="pt")
            answer = tok(row["output"] + "<|im_end|>", add_special_tokens=False, return_tensors="pt")["input_ids"]
            ids = torch.cat([inputs["input_ids"], answer], 1)
            pixels = {k: v for k, v in inputs.items() if k.startswith("pixel")}
            logits = model(input_ids=ids, **pixels).logits[0, -answer.shape[1] - 1 : -1]
            losses.append(-torch.log_softmax(logits, -1).gather(-1, answer[0, :, None]).mean())
    # the trainer's eval: rank r takes rows r, r + 2, ... in micro-batches of 2; the mean of per-batch means
    pairs = [rows[i : i + 2] for r in (0, 1) for rows in [list(range(r, ROWS, 2))] for i in range(0, len(rows), 2)]
    mean = sum((losses[a] * 1 + losses[b] * 1) / 2 for a, b in pairs) / len(pairs)
    assert float(mean) == pytest.approx(logged, rel=1e-4, abs=1e-4)
