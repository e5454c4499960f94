"""Bucket packing: exact round trips, size limits, layer grouping (pure torch, fast)."""

from __future__ import annotations

import pickle

import pytest
import torch

from openppo.rollout.buckets import (
    ALIGN_BYTES,
    BucketMeta,
    iter_buckets,
    layer_key,
    pack_buckets,
    plan_buckets,
    unpack_bucket,
)


def _named(seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = [("model.embed_tokens.weight", torch.randn(50, 8, generator=g))]
    for i in range(3):
        p = f"model.layers.{i}."
        out += [
            (p + "self_attn.q_proj.weight", torch.randn(8, 8, generator=g)),
            (p + "self_attn.q_proj.bias", torch.randn(8, generator=g).to(torch.bfloat16)),
            (p + "mlp.up_proj.weight", torch.randn(7, 8, generator=g).to(torch.bfloat16)),
            (p + "input_layernorm.weight", torch.randn(3, generator=g).to(torch.float16)),
            (p + "step", torch.tensor(5, dtype=torch.int64)),  # 0-dim, integer
            (p + "mask", torch.rand(5, generator=g) > 0.5),
        ]
    return out + [("model.norm.weight", torch.randn(8, generator=g)), ("empty", torch.empty(0, 4))]


def _unpack_all(buckets) -> list[tuple[str, torch.Tensor]]:
    return [item for b in buckets for item in unpack_bucket(b.meta, b.buffer)]


@pytest.mark.parametrize("bucket_bytes", [1, 64, 200, 1000, 1 << 20])
def test_round_trip_is_exact_and_ordered(bucket_bytes):
    named = _named()
    buckets = pack_buckets(named, bucket_bytes)
    back = _unpack_all(buckets)
    assert [n for n, _ in back] == [n for n, _ in named]
    for (_, a), (_, b) in zip(named, back):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)


def test_bucket_size_respected_and_oversized_tensor_alone():
    named = _named()
    bucket_bytes = 300  # embed (1600 B) is larger than a bucket; layer tensors are not
    buckets = pack_buckets(named, bucket_bytes)
    for b in buckets:
        assert b.buffer.numel() == b.meta.nbytes and b.buffer.dtype == torch.uint8
        if len(b.meta.tensors) > 1:
            assert b.meta.nbytes <= bucket_bytes
        else:
            assert b.meta.nbytes <= bucket_bytes or b.meta.tensors[0].nbytes > bucket_bytes
        assert all(t.offset % ALIGN_BYTES == 0 for t in b.meta.tensors)
    first = buckets[0].meta
    assert first.names == ["model.embed_tokens.weight"] and first.nbytes == 50 * 8 * 4


def test_a_layer_that_fits_is_never_split():
    named = _named()
    layer_bytes = 432  # aligned size of one layer group above
    for bucket_bytes in (layer_bytes, layer_bytes + 100, 2 * layer_bytes - 1, 5000):
        owner = {}
        for i, meta in enumerate(plan_buckets([(n, t.dtype, t.shape) for n, t in named], bucket_bytes)):
            for t in meta.tensors:
                if layer_key(t.name):
                    owner.setdefault(layer_key(t.name), set()).add(i)
        assert all(len(v) == 1 for v in owner.values()), (bucket_bytes, owner)


def test_a_layer_larger_than_a_bucket_is_split_between_tensors():
    named = _named()
    buckets = pack_buckets(named, 128)
    layer0 = [i for i, b in enumerate(buckets) for t in b.meta.tensors if t.name.startswith("model.layers.0.")]
    assert len(set(layer0)) > 1
    assert [n for n, _ in _unpack_all(buckets)] == [n for n, _ in named]


def test_plan_matches_packing_and_meta_survives_plain_rpc():
    named = _named()
    planned = plan_buckets([(n, t.dtype, t.shape) for n, t in named], 400)
    packed = pack_buckets(named, 400)
    assert planned == [b.meta for b in packed]
    for b in packed:
        plain = pickle.loads(pickle.dumps(b.meta.to_plain()))
        assert BucketMeta.coerce(plain) == b.meta
        assert all(
            torch.equal(x, y) for (_, x), (_, y) in zip(unpack_bucket(plain, b.buffer), unpack_bucket(b.meta, b.buffer))
        )


def test_dtype_cast_only_touches_floating_tensors_and_streams():
    named = _named()
    buckets = list(iter_buckets(iter(named), 256, dtype=torch.bfloat16))
    back = dict(_unpack_all(buckets))
    for name, t in named:
        if t.is_floating_point():
            assert back[name].dtype == torch.bfloat16
            assert torch.equal(back[name], t.to(torch.bfloat16))
        else:
            assert back[name].dtype == t.dtype and torch.equal(back[name], t)


def test_layer_key():
    assert layer_key("model.layers.12.mlp.up_proj.weight") == "model.layers.12"
    assert (
        layer_key("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight")
        == "base_model.model.model.layers.0"
    )
    assert layer_key("transformer.h.3.attn.c_attn.weight") == "transformer.h.3"
    assert layer_key("model.embed_tokens.weight") == ""
