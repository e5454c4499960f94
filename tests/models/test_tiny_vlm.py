"""The tiny vision-language model: an Idefics3 checkpoint with its processor, deterministic, built by the CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from PIL import Image

from openppo.errors import UserError
from openppo.models.tiny_vlm import IMAGE_TOKEN, build_tiny_vlm
from openppo.models.zoo import MARKER, describe
from tests.model_cache import REPO, TOKENIZER, tiny_vlm_dir


def test_reloads_with_its_processor_and_sees_the_image():
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = tiny_vlm_dir()
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(path)
    tok = processor.tokenizer
    config = model.config
    assert config.model_type == "idefics3" and config.text_config.model_type == "llama"
    assert config.text_config.vocab_size == len(tok) and config.image_token_id == tok.convert_tokens_to_ids(IMAGE_TOKEN)
    assert (tok.eos_token, tok.pad_token) == ("<|im_end|>", "<|endoftext|>")
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Count."}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True)
    assert text == "<|im_start|>user\n<image>Count.<|im_end|>\n<|im_start|>assistant\n"
    logits = []
    for color in ("red", "blue"):
        enc = processor(text=[text], images=[[Image.new("RGB", (40, 30), color)]], return_tensors="pt")
        assert enc["input_ids"][0].tolist().count(config.image_token_id) == 4
        with torch.no_grad():
            logits.append(model(**enc).logits[0, -1])
    assert (logits[0] - logits[1]).abs().max() > 1e-3  # the pixels reach the decoder


def test_same_arguments_same_weights_and_cli(tmp_path):
    from safetensors.torch import load_file

    first = build_tiny_vlm(tmp_path / "a", tokenizer=TOKENIZER, num_layers=1)
    assert build_tiny_vlm(tmp_path / "a", tokenizer=TOKENIZER, num_layers=1) == first  # cached
    out = subprocess.run(
        [sys.executable, "-m", "openppo.cli.models", "tiny-vlm", "--out", str(tmp_path / "b"), "--layers", "1"]
        + ["--tokenizer", TOKENIZER],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    folder, summary = out.stdout.splitlines()
    assert summary.startswith("tiny-vlm idefics3:") and describe(folder) in summary
    a, b = load_file(first / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((first / MARKER).read_text())["summary"]["image_tokens"] == 4


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(image_size=60), "--image_size 60 must be a multiple of patch_size"),
        (dict(tokenizer="gpt2"), "needs a Qwen3 vocabulary"),
        (dict(hidden_size=64, num_heads=4), "head_dim 16"),
        (dict(answers=("12",)), "--answers: '12' is 2 tokens"),
    ],
)
def test_bad_arguments_name_the_flag(tmp_path, kwargs, message):
    with pytest.raises(UserError, match=message):
        build_tiny_vlm(tmp_path / "bad", **kwargs)


def test_favoured_answers_start_uniform_and_change_only_their_rows(tmp_path):
    """`--answers 1,2,3,4` (the VLM demo's model): at a shapes prompt's answer position the fresh model says one of
    the counts, each as likely as the others, whatever the picture; only those four embedding rows differ from the
    plain build of the same seed."""
    from safetensors.torch import load_file
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from openppo.tasks.shapes import make_rows
    from openppo.utils.images import open_image

    path = build_tiny_vlm(tmp_path / "count", tokenizer=TOKENIZER, answers=("1", "2", "3", "4"))
    processor = AutoProcessor.from_pretrained(path)
    ids = [processor.tokenizer.convert_tokens_to_ids(str(n)) for n in range(1, 5)]
    assert json.loads((path / MARKER).read_text())["summary"]["answer_token_ids"] == ids
    plain, favoured = load_file(tiny_vlm_dir() / "model.safetensors"), load_file(path / "model.safetensors")
    assert plain.keys() == favoured.keys()
    changed = {k for k in plain if not torch.equal(plain[k], favoured[k])}
    assert changed == {"model.text_model.embed_tokens.weight"}, changed
    key = "model.text_model.embed_tokens.weight"
    rows = (plain[key] != favoured[key]).any(1).nonzero().flatten().tolist()
    assert rows == sorted(ids)

    model = AutoModelForImageTextToText.from_pretrained(path, dtype=torch.float32).eval()
    shapes = make_rows(16, seed=3)
    texts = [processor.apply_chat_template(r["prompt"], add_generation_prompt=True) for r in shapes]
    enc = processor(text=texts, images=[[open_image(r["images"][0])] for r in shapes], return_tensors="pt")
    with torch.no_grad():
        probs = model(**enc).logits[:, -1].softmax(-1)
    assert probs[:, ids].sum(1).min() > 0.95, probs[:, ids].sum(1)
    assert (probs[:, ids] - probs[:, ids[:1]]).abs().max() < 1e-6  # tied rows, equal logits: uniform over counts
