"""Image prompts: every kind of image reference, bad images skipped and counted, the rendered prompt's placeholders."""

import base64
import io
import json
import logging

import datasets
import pytest
from PIL import Image

from openppo.datasets import PromptDataset
from openppo.datasets.images import count_image_items
from openppo.errors import UserError
from openppo.utils.images import BadImage, open_image
from tests.model_cache import tiny_vlm_dir


def png_bytes(color="red", size=(20, 12)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def processor():
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(tiny_vlm_dir())


@pytest.fixture
def files(tmp_path):
    (tmp_path / "red.png").write_bytes(png_bytes("red"))
    (tmp_path / "blue.png").write_bytes(png_bytes("blue"))
    (tmp_path / "junk.png").write_bytes(b"not an image at all")
    (tmp_path / "cut.png").write_bytes(png_bytes("green", (64, 64))[:60])  # a truncated file
    return tmp_path


def test_every_kind_of_reference_decodes(files):
    raw = png_bytes("blue")
    b64 = base64.b64encode(raw).decode()
    red = str(files / "red.png")
    for ref in (red, f"data:image/png;base64,{b64}", b64, {"bytes": raw, "path": None}, {"bytes": None, "path": red}):
        image = open_image(ref)
        assert image.mode == "RGB" and image.size == (20, 12)
    assert open_image(f"data:image/png;base64,{b64}").getpixel((0, 0)) == (0, 0, 255)
    assert open_image(red).getpixel((3, 3)) == (255, 0, 0)


@pytest.mark.parametrize(
    "ref, message",
    [
        ("missing.png", "missing.png: no such file"),
        ("junk.png", "junk.png is not a readable image"),
        ("cut.png", "cut.png is not a readable image"),
        ("https://example.com/a.png", "URLs are not fetched"),
        ("data:image/png;base64,@@@@", "a data: URI is not valid base64"),
        ({"bytes": None, "path": None}, "neither bytes nor path"),
        (3, "got int"),
    ],
)
def test_bad_references_name_the_image(files, ref, message, monkeypatch):
    monkeypatch.chdir(files)  # relative paths are taken from the working directory
    with pytest.raises(BadImage, match=message.replace(".", r"\.").replace("(", r"\(")):
        open_image(ref)


def test_image_items_are_counted_in_every_message():
    messages = [
        {"role": "system", "content": "look"},
        {
            "role": "user",
            "content": [{"type": "image"}, {"type": "text", "text": "a"}, {"type": "image", "text": None}],
        },
    ]
    assert count_image_items(messages) == 2 and count_image_items("plain text") == 0


def user(text, num_images):
    return [{"role": "user", "content": [{"type": "image"}] * num_images + [{"type": "text", "text": text}]}]


def test_bad_rows_are_skipped_counted_and_named(files, processor, caplog):
    red, blue = str(files / "red.png"), str(files / "blue.png")
    rows = [
        {"prompt": user("one", 1), "images": [red], "label": "1"},
        {"prompt": user("two", 2), "images": [red, blue], "label": "2"},
        {"prompt": user("missing", 1), "images": [str(files / "nope.png")], "label": "x"},
        {"prompt": user("junk", 1), "images": [str(files / "junk.png")], "label": "x"},
        {"prompt": user("three", 3), "images": [red, red, blue], "label": "x"},
        {"prompt": user("mismatch", 1), "images": [red, blue], "label": "x"},
        {"prompt": user("text only", 0), "images": None, "label": "0"},
    ]
    ds = datasets.Dataset.from_list(rows)
    with caplog.at_level(logging.WARNING, logger="openppo.datasets.prompts"):
        prompts = PromptDataset(
            ds,
            processor.tokenizer,
            input_key="prompt",
            label_key="label",
            apply_chat_template=True,
            input_template=None,
            image_key="images",
            max_images=2,
            processor=processor,
        )
    assert [prompts[i]["index"] for i in range(len(prompts))] == [0, 1, 6]
    assert [prompts[i]["images"] for i in range(len(prompts))] == [[red], [red, blue], []]
    assert f"row 2: {files / 'nope.png'}: no such file" in caplog.text
    assert f"row 3: {files / 'junk.png'} is not a readable image" in caplog.text
    assert "row 4: 3 images, more than --max_images_per_prompt 2" in caplog.text
    assert "row 5: 2 image(s) in --image_key 'images' but 1 image item(s) in the prompt" in caplog.text
    assert "skipped 4 of 7 prompts with bad images (--image_key images)" in caplog.text
    # One unexpanded placeholder per image: the engine and the processor expand it.
    image_id = processor.tokenizer.convert_tokens_to_ids("<image>")
    assert [prompts[i]["prompt_ids"].count(image_id) for i in range(3)] == [1, 2, 0]
    assert prompts[1]["prompt"] == "<|im_start|>user\n<image><image>two<|im_end|>\n<|im_start|>assistant\n"
    # Text-only when max_images is 0: the column is not even read.
    text_only = PromptDataset(
        ds.select([6]),
        processor.tokenizer,
        input_key="prompt",
        label_key=None,
        apply_chat_template=True,
        input_template=None,
        image_key="images",
        max_images=0,
    )
    assert "images" not in text_only[0]


def test_all_bad_or_misnamed_stops_the_run(files, processor):
    ds = datasets.Dataset.from_list([{"prompt": user("q", 1), "images": [str(files / "junk.png")]}])
    args = dict(input_key="prompt", label_key=None, input_template=None, max_images=1, processor=processor)
    with pytest.raises(UserError, match=r"--image_key: all 1 prompts have bad images \(first: row 0: .*junk.png"):
        PromptDataset(ds, processor.tokenizer, apply_chat_template=True, image_key="images", **args)
    with pytest.raises(UserError, match="--image_key: column 'pictures' not found"):
        PromptDataset(ds, processor.tokenizer, apply_chat_template=True, image_key="pictures", **args)
    with pytest.raises(UserError, match="pass --apply_chat_template"):
        PromptDataset(ds, processor.tokenizer, apply_chat_template=False, image_key="images", **args)


def test_jsonl_rows_with_base64_and_paths(files, processor, tmp_path):
    b64 = base64.b64encode(png_bytes("blue")).decode()
    path = tmp_path / "data.jsonl"
    rows = [
        {"prompt": user("a", 1), "images": [f"data:image/png;base64,{b64}"]},
        {"prompt": user("b", 1), "images": [str(files / "red.png")]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    from openppo.datasets.loading import read_source

    prompts = PromptDataset(
        read_source(str(path), flag="--prompt_data"),
        processor.tokenizer,
        input_key="prompt",
        label_key=None,
        apply_chat_template=True,
        input_template=None,
        image_key="images",
        max_images=1,
        processor=processor,
    )
    assert len(prompts) == 2 and open_image(prompts[0]["images"][0]).getpixel((0, 0)) == (0, 0, 255)


def test_the_all_bad_error_names_what_the_rows_are(caplog):
    from openppo.datasets.images import report_bad_images

    report_bad_images("SFT data", "samples", ["row 0: a.png"], 2, "images")  # one row left: counted, no error
    assert "SFT data: skipped 1 of 2 samples with bad images (--image_key images)" in caplog.text
    with pytest.raises(UserError, match=r"--image_key: all 2 samples have bad images \(first: row 0: a.png\)"):
        report_bad_images("SFT data", "samples", ["row 0: a.png", "row 1: b.png"], 2, "images")


def test_prompt_max_len_counts_each_image_expanded(files, processor, caplog):
    """An image prompt is as long as the processor makes it (each placeholder replaced by the image's tokens, as
    vLLM's processor does), which is what the engines' context must hold: the limit is taken on that length."""
    red, blue = str(files / "red.png"), str(files / "blue.png")
    rows = [{"prompt": user("two", 2), "images": [red, blue]}, {"prompt": user("text", 0), "images": None}]
    args = dict(input_key="prompt", label_key=None, apply_chat_template=True, input_template=None)
    both = PromptDataset(datasets.Dataset.from_list(rows), processor.tokenizer, **args)  # text only: no limit
    unexpanded = len(both[0]["prompt_ids"])
    expanded = processor(text=[both[0]["prompt"]], images=[[open_image(red), open_image(blue)]])["input_ids"][0]
    assert len(expanded) > unexpanded + 2  # several tokens per image

    def kept(limit: int) -> list[int]:
        prompts = PromptDataset(
            datasets.Dataset.from_list(rows),
            processor.tokenizer,
            **args,
            image_key="images",
            max_images=2,
            processor=processor,
            max_prompt_len=limit,
        )
        return [prompts[i]["index"] for i in range(len(prompts))]

    with caplog.at_level(logging.WARNING, logger="openppo.datasets.prompts"):
        assert kept(len(expanded)) == [0, 1]
        assert kept(len(expanded) - 1) == [1]
    assert "dropped 1 of 2 prompts longer than" in caplog.text


def test_sft_image_samples_render_with_the_processors_chat_template(files):
    """An image SFT sample is rendered as RL renders an image prompt: with the processor's chat template, which
    here writes a system line the tokenizer's does not; the response follows it and ends with EOS."""
    from transformers import AutoProcessor

    from openppo.datasets import SFTDataset

    own = AutoProcessor.from_pretrained(tiny_vlm_dir())
    own.chat_template = "{{- '<|im_start|>system\\nLook.<|im_end|>\\n' }}" + own.chat_template
    tok = own.tokenizer
    assert "Look." not in tok.chat_template
    rows = [{"q": user("How many?", 1), "a": "3", "images": [str(files / "red.png")]}]
    args = dict(input_key="q", output_key="a", apply_chat_template=True, input_template=None, max_len=64)
    ds = SFTDataset(datasets.Dataset.from_list(rows), tok, **args, image_key="images", max_images=1, processor=own)
    sample = ds[0]
    text = tok.decode(sample["input_ids"])
    assert text.startswith("<|im_start|>system\nLook.<|im_end|>\n<|im_start|>user\n<fake_token_around_image>"), text
    trained = tok.decode([t for t, m in zip(sample["input_ids"], sample["loss_mask"]) if m])
    assert trained == "3" + tok.eos_token, trained


def test_image_data_needs_the_processors_chat_template_not_the_tokenizers(files):
    """Image prompts and samples are rendered by the processor's template: a tokenizer without one is no reason to
    refuse them, and a processor without one is named in the error."""
    import copy

    from transformers import AutoProcessor

    from openppo.datasets import SFTDataset

    own = AutoProcessor.from_pretrained(tiny_vlm_dir())
    tok = copy.deepcopy(own.tokenizer)
    tok.chat_template = None
    rows = [{"q": user("How many?", 1), "a": "3", "images": [str(files / "red.png")]}]
    data = datasets.Dataset.from_list(rows)
    common = dict(input_key="q", apply_chat_template=True, input_template=None, image_key="images", max_images=1)
    sft = dict(output_key="a", max_len=64)
    assert len(SFTDataset(data, tok, **common, **sft, processor=own)) == 1
    assert len(PromptDataset(data, tok, **common, label_key=None, processor=own)) == 1
    own.chat_template = None
    with pytest.raises(UserError, match="--apply_chat_template: the processor of --pretrain has no chat template"):
        SFTDataset(data, tok, **common, **sft, processor=own)
    with pytest.raises(UserError, match="--apply_chat_template: the processor of --pretrain has no chat template"):
        PromptDataset(data, tok, **common, label_key=None, processor=own)
