"""Image references: reading one into a PIL image, and carrying a batch's worth through a tensor.

An image is a file path (relative paths from the working directory, as OpenRLHF takes them), a
`data:image/...;base64,` URI or bare base64, the `{"bytes", "path"}` record a `datasets.Image` column stores in
parquet, or a PIL image. URLs are refused: training boxes often have no network, and a run should not depend on a
server it cannot see. The data (`openppo.datasets.images`), the engines and the models' processors all read images
through `open_image`, so an image means the same thing everywhere.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
import re
from pathlib import Path
from typing import Any

import torch

# The key of the rows' encoded images in a training batch: one value per row, not per token.
BATCH_KEY = "images"

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


def encode_image_rows(rows: list[list[Any]]) -> torch.Tensor:
    """The rows' image references as one uint8 tensor [B, N] (each row: 8 bytes of length, then the pickled list,
    zero-padded), so that they ride a training batch (a dict of row-indexed tensors) to the ranks unchanged."""
    blobs = [pickle.dumps(list(row), protocol=pickle.HIGHEST_PROTOCOL) for row in rows]
    width = 8 + max(len(b) for b in blobs)
    out = torch.zeros((len(rows), width), dtype=torch.uint8)
    for i, blob in enumerate(blobs):
        data = len(blob).to_bytes(8, "little") + blob
        out[i, : len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return out


def decode_image_rows(encoded: torch.Tensor) -> list[list[Any]]:
    """The inverse of `encode_image_rows` (the rows of a micro-batch, in its order)."""
    rows = []
    for row in encoded.cpu():
        data = row.numpy().tobytes()
        rows.append(pickle.loads(data[8 : 8 + int.from_bytes(data[:8], "little")]))
    return rows
