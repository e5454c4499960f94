"""Images of image prompts: where they come from, how many a prompt may carry, what a bad one does to its row.

The column named by `--image_key` holds, per row, one image or a list of them (none: a text-only row). An image
is a file path (relative paths from the working directory, as OpenRLHF takes them), a `data:image/...;base64,`
URI or bare base64, or the `{"bytes", "path"}` record a `datasets.Image` column stores in parquet. URLs are
refused: training boxes often have no network, and a run should not depend on a server it cannot see.

The prompt says where each image goes with a `{"type": "image"}` content item (OpenRLHF's and transformers'
format); the processor's chat template renders it as the model's image placeholder.

A row whose images are bad (a missing or undecodable file, more than `--max_images_per_prompt`, a count that
differs from the prompt's image items) is skipped and counted, with one log line naming the row and the image,
and the run stops only when no row is left. Why skip: image sets gathered from the web routinely hold a few
broken files, and one of them should not end a run of thousands of prompts; the count in the log says how many
were lost, and a run whose data is wholesale wrong (a wrong folder, a wrong column) still stops at once.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
from pathlib import Path
from typing import Any

from openppo.errors import UserError

# Log lines for the first few bad rows; the rest are only counted.
MAX_BAD_ROWS_LOGGED = 5

_DATA_URI = re.compile(r"^data:image/[\w.+-]+;base64,", re.IGNORECASE)
_BASE64 = re.compile(r"^[A-Za-z0-9+/=\s]+$")
_MIN_BASE64_CHARS = 64  # shorter strings are taken for (missing) file names, not for inline images


class BadImage(ValueError):
    """An image that cannot be used; the message names the image, not the row (the caller adds the row)."""


def image_refs(value: Any) -> list[Any]:
    """The images of one row's `--image_key` value, as a list (None or [] for a text-only row)."""
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple) else [value]


def describe_ref(ref: Any) -> str:
    """A short name for an image in messages: its path, or what kind of inline image it is."""
    if isinstance(ref, dict):
        return str(ref.get("path") or "inline bytes")
    if isinstance(ref, str):
        if _DATA_URI.match(ref):
            return "a data: URI"
        return ref if len(ref) <= 120 else ref[:117] + "..."
    return type(ref).__name__


def open_image(ref: Any):
    """The PIL image `ref` holds, decoded and in RGB; BadImage when it cannot be read."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(ref, Image.Image):
        return ref.convert("RGB")
    data = _image_bytes(ref)
    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.convert("RGB")  # convert() decodes the whole image: a truncated file fails here
    except (UnidentifiedImageError, OSError, ValueError) as err:
        raise BadImage(f"{describe_ref(ref)} is not a readable image ({err})") from err


def _image_bytes(ref: Any) -> bytes:
    if isinstance(ref, dict):  # a datasets.Image record
        if ref.get("bytes") is not None:
            return ref["bytes"]
        if ref.get("path"):
            return _read_file(ref["path"])
        raise BadImage("an image record with neither bytes nor path")
    if isinstance(ref, bytes):
        return ref
    if not isinstance(ref, str) or not ref.strip():
        raise BadImage(f"expected a path, a base64 string or an image record, got {type(ref).__name__}")
    if ref.startswith(("http://", "https://")):
        raise BadImage(f"{describe_ref(ref)}: URLs are not fetched; download the images and give their paths")
    if _DATA_URI.match(ref):
        return _decode_base64(ref[ref.index(",") + 1 :], ref)
    if not Path(ref).expanduser().exists() and len(ref) >= _MIN_BASE64_CHARS and _BASE64.match(ref):
        return _decode_base64(ref, ref)
    return _read_file(ref)


def _decode_base64(text: str, ref: str) -> bytes:
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError) as err:
        raise BadImage(f"{describe_ref(ref)} is not valid base64 ({err})") from err


def _read_file(path: str) -> bytes:
    try:
        return Path(path).expanduser().read_bytes()
    except FileNotFoundError as err:
        raise BadImage(f"{path}: no such file") from err
    except OSError as err:
        raise BadImage(f"{path}: {err.strerror or err}") from err


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


def check_row_images(prompt: Any, value: Any, *, max_images: int, image_flag: str) -> list[Any]:
    """The row's image references after checking them all (each one decoded once); BadImage says what is wrong."""
    refs = image_refs(value)
    if len(refs) > max_images:
        raise BadImage(f"{len(refs)} images, more than --max_images_per_prompt {max_images}")
    slots = count_image_items(prompt)
    if slots != len(refs):
        raise BadImage(f"{len(refs)} image(s) in {image_flag} but {slots} image item(s) in the prompt")
    for ref in refs:
        open_image(ref)
    return refs


def no_rows_left(num_rows: int, first_error: str) -> UserError:
    """The error for a dataset whose every row had bad images."""
    return UserError(
        f"--image_key: all {num_rows} prompts have bad images (first: {first_error}); "
        "fix the image paths or the column named by --image_key"
    )
