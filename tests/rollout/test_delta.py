"""Delta weight sync's encoding (pure torch): the receiver ends with the sender's exact bits, and only changed
elements travel (counts computed by hand). With real engines: tests/rollout/test_transport.py."""

from __future__ import annotations

import pytest
import torch

from openppo.rollout.buckets import iter_buckets, unpack_bucket
from openppo.rollout.delta import INDEX_SUFFIX, VALUE_SUFFIX, DeltaDecoder, DeltaEncoder, changed_indices


def _through_buckets(named, bucket_bytes=256):
    """What a worker unpacks: the entries packed into small buckets (so a tensor's index and values may part)."""
    for bucket in iter_buckets(named, bucket_bytes):
        yield from unpack_bucket(bucket.meta, bucket.buffer)


def _sync(encoder, decoder, weights):
    return dict(decoder.decode(_through_buckets(encoder.encode(weights.items()))))


def test_changes_travel_and_the_receiver_ends_with_the_senders_bits():
    weights = {"a.weight": torch.zeros(4, 4), "b.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    encoder, decoder = DeltaEncoder(None), DeltaDecoder()
    got = _sync(encoder, decoder, weights)  # first sync: in full
    assert encoder.stats.sent == encoder.stats.elements == 22 and encoder.stats.full_bytes == 22 * 4
    assert all(torch.equal(got[k], v) for k, v in weights.items())

    weights["a.weight"][1, 2] = 5.0
    weights["a.weight"][3, 3] = -0.0  # equal to 0.0, other bits: sent, so the engine holds the same bits
    weights["b.weight"][0, 0] = float("nan")
    entries = dict(encoder.encode(weights.items()))
    assert entries["a.weight" + INDEX_SUFFIX].tolist() == [6, 15]
    assert entries["a.weight" + VALUE_SUFFIX].tolist() == [5.0, 0.0]
    assert entries["b.weight" + INDEX_SUFFIX].tolist() == [0]
    assert (encoder.stats.sent, encoder.stats.elements) == (3, 22)

    decoder2 = DeltaDecoder()  # the same stream into a receiver at the first sync's state
    decoder2.decode(_through_buckets(DeltaEncoder(None).encode(_first(weights))))
    got = dict(decoder2.decode(_through_buckets(entries.items())))
    for k, v in weights.items():
        assert torch.equal(got[k].view(torch.int32), v.view(torch.int32)), k  # bitwise: -0.0 and NaN included

    entries = dict(encoder.encode(weights.items()))  # nothing changed (NaN against the same NaN included)
    assert encoder.stats.sent == 0 and entries["b.weight" + INDEX_SUFFIX].numel() == 0


def _first(weights):
    """The first sync's weights of the test above."""
    first = {"a.weight": torch.zeros(4, 4), "b.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3)}
    return [(k, first[k]) for k in weights]


def test_a_bf16_engine_gets_only_the_elements_whose_bf16_value_moved():
    """bf16 spacing at 1.0 is 2**-7 = 0.0078: +0.001 rounds back to 1.0 (not sent), +0.01 does not."""
    w = torch.ones(100)
    encoder, decoder = DeltaEncoder(torch.bfloat16), DeltaDecoder()
    _sync(encoder, decoder, {"w": w})
    w[:97] += 0.001
    w[97:] += 0.01
    got = _sync(encoder, decoder, {"w": w})
    assert (encoder.stats.sent, encoder.stats.full_bytes) == (3, 200)
    assert got["w"].dtype == torch.bfloat16 and torch.equal(got["w"], w.to(torch.bfloat16))


def test_a_tensor_whose_changes_outweigh_it_is_sent_in_full():
    """fp32 with int32 indices: 8 bytes per changed element against 4 per element, so more than half changed -> full."""
    w = torch.zeros(10)
    encoder, decoder = DeltaEncoder(None), DeltaDecoder()
    _sync(encoder, decoder, {"w": w})
    w[:5] = 1.0  # 5 x 8 = 40 bytes = the tensor's 40: in full
    assert [k for k, _ in encoder.encode({"w": w}.items())] == ["w"] and encoder.stats.sent == 10
    w[:4] = 2.0  # 4 x 8 = 32 bytes < 40: the changes
    entries = dict(encoder.encode({"w": w}.items()))
    assert entries["w" + INDEX_SUFFIX].tolist() == [0, 1, 2, 3] and encoder.stats.sent == 4


def test_a_new_shape_is_sent_in_full_and_the_decoder_keeps_its_own_copy():
    encoder, decoder = DeltaEncoder(None), DeltaDecoder()
    _sync(encoder, decoder, {"w": torch.zeros(3)})
    got = _sync(encoder, decoder, {"w": torch.ones(5)})
    assert encoder.stats.sent == 5 and torch.equal(got["w"], torch.ones(5))
    got["w"].fill_(7.0)  # what the engine loads may be processed in place: the decoder's base is not
    assert torch.equal(_sync(encoder, decoder, {"w": torch.ones(5)})["w"], torch.ones(5))


def test_a_change_before_the_full_tensor_is_refused():
    entries = [("w" + INDEX_SUFFIX, torch.tensor([0], dtype=torch.int32)), ("w" + VALUE_SUFFIX, torch.ones(1))]
    with pytest.raises(RuntimeError, match="changes to w arrived before its full tensor"):
        DeltaDecoder().decode(entries)


def test_changed_indices_compare_bits():
    new = torch.tensor([0.0, -0.0, 1.0, float("nan")], dtype=torch.bfloat16)
    old = torch.tensor([0.0, 0.0, 1.0, float("nan")], dtype=torch.bfloat16)
    index = changed_indices(new, old)
    assert index.dtype == torch.int32 and index.tolist() == [1]
