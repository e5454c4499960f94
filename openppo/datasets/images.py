"""Images of image prompts: where they come from, how many a prompt may carry, what a bad one does to its row.

The column named by `--image_key` holds, per row, one image or a list of them (none: a text-only row); what an
image may be is `openppo.utils.images`'s.

The prompt says where each image goes with a `{"type": "image"}` content item (OpenRLHF's and transformers'
format); the processor's chat template renders it as the model's image placeholder.

A row whose images are bad (a missing or undecodable file, more than `--max_images_per_prompt`, a count that
differs from the prompt's image items) is skipped and counted, with one log line naming the row and the image,
and the run stops only when no row is left. Why skip: image sets gathered from the web routinely hold a few
broken files, and one of them should not end a run of thousands of prompts; the count in the log says how many
were lost, and a run whose data is wholesale wrong (a wrong folder, a wrong column) still stops at once.
"""

from __future__ import annotations

import logging
from typing import Any

from openppo.errors import UserError
from openppo.utils.images import BadImage, image_refs, open_image

logger = logging.getLogger(__name__)

# Log lines for the first few bad rows; the rest are only counted.
MAX_BAD_ROWS_LOGGED = 5


def count_image_items(messages: Any) -> int:
    """How many `{"type": "image"}` content items the prompt's messages hold (0 for a plain string prompt)."""
    if not isinstance(messages, list):
        return 0
    count = 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            count += sum(1 for item in content if isinstance(item, dict) and item.get("type") == "image")
    return count


def check_row_images(prompt: Any, value: Any, *, max_images: int, image_flag: str) -> tuple[list[Any], list[Any]]:
    """The row's image references and their decoded images, after checking them all (each one decoded once, here:
    the caller measures or encodes with these); BadImage says what is wrong."""
    refs = image_refs(value)
    if len(refs) > max_images:
        raise BadImage(f"{len(refs)} images, more than --max_images_per_prompt {max_images}")
    slots = count_image_items(prompt)
    if slots != len(refs):
        raise BadImage(f"{len(refs)} image(s) in {image_flag} but {slots} image item(s) in the prompt")
    return refs, [open_image(ref) for ref in refs]


def report_bad_images(data: str, items: str, bad_images: list[str], num_rows: int, image_key: str) -> None:
    """One log line counting the `items` (prompts, samples) of `data` skipped for bad images; the error when no row
    is left. `bad_images`: each skipped row's reason, first first."""
    if not bad_images:
        return
    logger.warning(
        "%s: skipped %d of %d %s with bad images (--image_key %s)", data, len(bad_images), num_rows, items, image_key
    )
    if len(bad_images) == num_rows:
        raise UserError(
            f"--image_key: all {num_rows} {items} have bad images (first: {bad_images[0]}); "
            "fix the image paths or the column named by --image_key"
        )
