"""Count the shapes: a picture of 1..max_shapes circles, squares and triangles, the count as label.

The built-in image task for vision-language RL (docs/vlm.md): generated locally and seeded, so it needs no download.
Each image is a small PNG inlined in its row as a data URI, so the JSONL file is self-contained (no image folder to
carry to every node). Shapes sit in distinct cells of a 3 x 3 grid with some jitter, so they never touch and the
count is unambiguous. The reward is the arithmetic task's: 1.0 when the last number in the response is the count.
"""

from __future__ import annotations

import base64
import io
import random

from openppo.errors import require
from openppo.tasks.arithmetic import reward  # noqa: F401  (the task's reward: the last number equals the label)

QUESTION = "How many shapes are in the picture? Reply with only the number."
KINDS = ("circle", "square", "triangle")
COLORS = ("red", "green", "blue", "orange", "purple", "black")
_GRID = 3


def draw(shapes: list[tuple[str, str, int, int, int]], size: int):
    """A white `size` x `size` RGB picture of `shapes`: (kind, color, x, y, side) with (x, y) the top-left corner."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (size, size), "white")
    pen = ImageDraw.Draw(image)
    for kind, color, x, y, side in shapes:
        box = (x, y, x + side, y + side)
        if kind == "circle":
            pen.ellipse(box, fill=color)
        elif kind == "square":
            pen.rectangle(box, fill=color)
        else:
            pen.polygon([(x + side / 2, y), (x, y + side), (x + side, y + side)], fill=color)
    return image


def make_rows(n: int, *, seed: int = 0, max_shapes: int = 4, image_size: int = 56) -> list[dict]:
    """`n` rows {prompt, images, label}: a one-image chat prompt, the picture as a PNG data URI, the count."""
    require(1 <= max_shapes <= _GRID * _GRID, f"--max_shapes must be in 1..{_GRID * _GRID}, got {max_shapes}")
    require(image_size >= 4 * _GRID, f"--image_size must be at least {4 * _GRID} pixels, got {image_size}")
    rng = random.Random(seed)
    cell = image_size // _GRID
    rows = []
    for _ in range(n):
        count = rng.randint(1, max_shapes)
        shapes = []
        for slot in rng.sample(range(_GRID * _GRID), count):
            # PIL draws both edges of a box: a shape spans side + 1 pixels, and a blank line must remain between
            # the shapes of neighbouring cells (else two would touch and look like one).
            side = rng.randint(cell // 2, cell - 3)
            x = (slot % _GRID) * cell + rng.randint(0, cell - side - 2)
            y = (slot // _GRID) * cell + rng.randint(0, cell - side - 2)
            shapes.append((rng.choice(KINDS), rng.choice(COLORS), x, y, side))
        buffer = io.BytesIO()
        draw(shapes, image_size).save(buffer, format="PNG")
        uri = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
        prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
        rows.append({"prompt": prompt, "images": [uri], "label": str(count)})
    return rows
