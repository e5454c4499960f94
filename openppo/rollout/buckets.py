"""Packing named tensors into flat byte buckets for weight transfer (pure torch).

One weight sync sends a model as a few large messages instead of one message per parameter: the tensors are
copied, back to back, into a flat `uint8` buffer of at most `bucket_bytes`, and a small metadata record says where
each tensor lives in it (`TensorMeta`: name, dtype, shape, byte offset, numel). The receiver allocates the same
buffer, receives it in one collective, and takes zero-copy views back out (`unpack_bucket`).

Rules:

* A bucket holds at most `bucket_bytes` bytes, alignment padding included, unless it holds a single tensor that is
  larger than `bucket_bytes` on its own: such a tensor gets a bucket to itself.
* Tensors of one layer (`model.layers.7.` ...) are kept in one bucket when the whole layer fits in a bucket: a new
  bucket is started rather than splitting the layer. A layer larger than a bucket is split between tensors. (The
  engine applies all buckets of one sync inside one reload window, so a split layer is still loaded correctly;
  keeping layers whole keeps vLLM from buffering half-loaded layers between buckets.)
* Each tensor starts at a multiple of `ALIGN_BYTES`, so `view(dtype)` on the received bytes is always legal.
* Order is preserved: unpacking all buckets in order yields the input order.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

DEFAULT_BUCKET_BYTES = 256 * 1024 * 1024
ALIGN_BYTES = 16

_LAYER_PREFIX = re.compile(r"^(.*?\.(?:layers|h|blocks|layer)\.\d+)\.")


def layer_key(name: str) -> str:
    """The layer a parameter belongs to (`model.layers.3.mlp.up_proj.weight` -> `model.layers.3`), else ''."""
    match = _LAYER_PREFIX.match(name)
    return match.group(1) if match else ""


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    assert isinstance(dtype, torch.dtype), f"not a torch dtype: {name}"
    return dtype


def _align(n: int) -> int:
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


@dataclass(frozen=True)
class TensorMeta:
    """Where one tensor lives inside a bucket's flat byte buffer."""

    name: str
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"
    shape: tuple[int, ...]
    offset: int  # byte offset in the bucket, a multiple of ALIGN_BYTES
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_from_name(self.dtype).itemsize


@dataclass(frozen=True)
class BucketMeta:
    """The layout of one bucket: its tensors in order and the buffer size in bytes."""

    tensors: tuple[TensorMeta, ...]
    nbytes: int

    def to_plain(self) -> dict:
        """Only builtins (lists, ints, strings): safe for any RPC serializer (msgpack, json)."""
        return {
            "nbytes": self.nbytes,
            "tensors": [[t.name, t.dtype, list(t.shape), t.offset, t.numel] for t in self.tensors],
        }

    @classmethod
    def coerce(cls, meta: BucketMeta | dict) -> BucketMeta:
        """Accept a BucketMeta or its `to_plain()` form (what arrives after an RPC hop that drops classes)."""
        if isinstance(meta, BucketMeta):
            return meta
        tensors = tuple(
            TensorMeta(name, dtype, tuple(shape), offset, numel)
            for name, dtype, shape, offset, numel in meta["tensors"]
        )
        return cls(tensors=tensors, nbytes=meta["nbytes"])

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.tensors]


@dataclass
class Bucket:
    """A packed bucket: the flat `uint8` buffer and its layout."""

    meta: BucketMeta
    buffer: torch.Tensor  # [meta.nbytes] uint8


class _Planner:
    """Greedy bucket layout over (name, dtype, shape) specs, grouped by layer."""

    def __init__(self, bucket_bytes: int):
        assert bucket_bytes > 0, "bucket_bytes must be positive"
        self.bucket_bytes = bucket_bytes
        self.current: list[TensorMeta] = []
        self.used = 0  # aligned bytes taken in the current bucket

    def _flush(self) -> BucketMeta | None:
        if not self.current:
            return None
        last = self.current[-1]
        meta = BucketMeta(tensors=tuple(self.current), nbytes=last.offset + last.nbytes)
        self.current, self.used = [], 0
        return meta

    def _place(self, name: str, dtype: torch.dtype, shape: Sequence[int]) -> None:
        numel = _numel(shape)
        self.current.append(TensorMeta(name, dtype_name(dtype), tuple(int(d) for d in shape), self.used, numel))
        self.used = _align(self.used + numel * dtype.itemsize)

    def add_group(self, specs: list[tuple[str, torch.dtype, Sequence[int]]]) -> list[BucketMeta]:
        """Place one layer's tensors; return the buckets that became full."""
        done: list[BucketMeta] = []
        sizes = [_align(_numel(shape) * dtype.itemsize) for _, dtype, shape in specs]
        group_bytes = sum(sizes)
        if self.used + group_bytes > self.bucket_bytes and group_bytes <= self.bucket_bytes:
            # The layer fits in a bucket of its own but not in what is left of this one: start a new bucket.
            done += [m for m in [self._flush()] if m]
        for (name, dtype, shape), size in zip(specs, sizes):
            if self.current and self.used + size > self.bucket_bytes:
                done += [m for m in [self._flush()] if m]
            self._place(name, dtype, shape)
            if size >= self.bucket_bytes:
                done += [m for m in [self._flush()] if m]  # an oversized tensor: alone in its bucket
        return done

    def finish(self) -> list[BucketMeta]:
        return [m for m in [self._flush()] if m]


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _grouped(items: Iterable, name_of) -> Iterator[list]:
    """Consecutive items with the same layer key, as lists."""
    group: list = []
    key = None
    for item in items:
        k = layer_key(name_of(item))
        if group and k != key:
            yield group
            group = []
        key = k
        group.append(item)
    if group:
        yield group


def plan_buckets(
    specs: Iterable[tuple[str, torch.dtype, Sequence[int]]], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> list[BucketMeta]:
    """The bucket layouts for tensors described by (name, dtype, shape), without touching any data."""
    planner = _Planner(bucket_bytes)
    metas: list[BucketMeta] = []
    for group in _grouped(specs, lambda s: s[0]):
        metas += planner.add_group(group)
    return metas + planner.finish()


def pack_bucket(meta: BucketMeta, tensors: Sequence[torch.Tensor], device: torch.device | str = "cpu") -> Bucket:
    """Copy `tensors` (in `meta` order; cast to the planned dtype) into a new flat buffer on `device`."""
    assert len(tensors) == len(meta.tensors), "one tensor per planned slot"
    buffer = torch.empty(meta.nbytes, dtype=torch.uint8, device=device)
    for slot, tensor in zip(meta.tensors, tensors):
        dtype = dtype_from_name(slot.dtype)
        assert tuple(tensor.shape) == slot.shape, f"{slot.name}: shape {tuple(tensor.shape)} != planned {slot.shape}"
        src = tensor.detach().to(dtype).contiguous().reshape(-1).view(torch.uint8)
        buffer[slot.offset : slot.offset + slot.nbytes].copy_(src)
    return Bucket(meta=meta, buffer=buffer)


def iter_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
) -> Iterator[Bucket]:
    """Stream packed buckets from a stream of (name, tensor), holding at most one layer plus one bucket.

    `dtype`, when given, casts floating-point tensors (e.g. fp32 trainer weights to a bf16 engine) before packing,
    which also halves the bytes sent; integer and bool tensors keep their dtype.
    """
    planner = _Planner(bucket_bytes)
    pending: dict[str, torch.Tensor] = {}  # tensors placed in the planner but not yet packed

    def packed(metas: list[BucketMeta]) -> Iterator[Bucket]:
        for meta in metas:
            yield pack_bucket(meta, [pending.pop(t.name) for t in meta.tensors], device)

    for group in _grouped(named_tensors, lambda item: item[0]):
        specs = []
        for name, tensor in group:
            assert name not in pending, f"duplicate tensor name {name}"
            target = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
            pending[name] = tensor
            specs.append((name, target, tuple(tensor.shape)))
        yield from packed(planner.add_group(specs))
    yield from packed(planner.finish())
    assert not pending, "every planned tensor is packed"


def pack_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
) -> list[Bucket]:
    """All buckets at once (see `iter_buckets`)."""
    return list(iter_buckets(named_tensors, bucket_bytes, dtype=dtype, device=device))


def unpack_bucket(meta: BucketMeta | dict, buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) views into `buffer` (no copy): valid while `buffer` is alive and unchanged."""
    meta = BucketMeta.coerce(meta)
    assert buffer.dtype == torch.uint8 and buffer.numel() == meta.nbytes, (
        f"bucket buffer has {buffer.numel()} {buffer.dtype} elements, expected {meta.nbytes} uint8"
    )
    return [
        (t.name, buffer[t.offset : t.offset + t.nbytes].view(dtype_from_name(t.dtype)).view(t.shape))
        for t in meta.tensors
    ]
