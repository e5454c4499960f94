"""The built-in image task: seeded pictures whose shape count is the label, loadable as image prompts."""

import json
import subprocess
import sys

import datasets

from openppo.datasets import PromptDataset
from openppo.tasks import shapes
from openppo.utils.images import open_image
from tests.model_cache import REPO, tiny_vlm_dir


def count_blobs(image) -> int:
    """Connected regions of non-white pixels (4-neighbour flood fill): an independent count of the shapes drawn."""
    width, height = image.size
    pixels = image.load()
    seen = set()
    blobs = 0
    for start in ((x, y) for y in range(height) for x in range(width)):
        if start in seen or pixels[start] == (255, 255, 255):
            continue
        blobs += 1
        stack = [start]
        seen.add(start)
        while stack:
            x, y = stack.pop()
            for nxt in ((x + 1, y), (x - 1, y), (x, y + 1), (x, y - 1)):
                if 0 <= nxt[0] < width and 0 <= nxt[1] < height and nxt not in seen:
                    if pixels[nxt] != (255, 255, 255):
                        seen.add(nxt)
                        stack.append(nxt)
    return blobs


def test_labels_count_the_shapes_drawn():
    rows = shapes.make_rows(40, seed=3, max_shapes=5)
    assert rows == shapes.make_rows(40, seed=3, max_shapes=5) and rows != shapes.make_rows(40, seed=4, max_shapes=5)
    labels = [int(r["label"]) for r in rows]
    assert min(labels) == 1 and max(labels) == 5
    for row in rows:
        [uri] = row["images"]
        image = open_image(uri)
        assert image.size == (56, 56) and count_blobs(image) == int(row["label"])
    assert shapes.reward("There are 3", "3") == 1.0 and shapes.reward("4", "3") == 0.0


def test_make_task_writes_rows_the_prompt_data_reads(tmp_path):
    from transformers import AutoProcessor

    out = tmp_path / "shapes.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "openppo.cli.make_task", "--task", "shapes", "--out", str(out), "--num_samples", "6"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert len(out.read_text().splitlines()) == 6 and set(json.loads(out.read_text().splitlines()[0])) == {
        "prompt",
        "images",
        "label",
    }
    processor = AutoProcessor.from_pretrained(tiny_vlm_dir())
    prompts = PromptDataset(
        datasets.Dataset.from_json(str(out)),
        processor.tokenizer,
        input_key="prompt",
        label_key="label",
        apply_chat_template=True,
        input_template=None,
        image_key="images",
        max_images=1,
        processor=processor,
    )
    assert len(prompts) == 6 and all(len(prompts[i]["images"]) == 1 for i in range(6))
    assert shapes.QUESTION in prompts[0]["prompt"]
