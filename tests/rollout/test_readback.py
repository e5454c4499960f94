"""`check_engine_weights`: engine workers' slices against the trainer's full tensors (pure; the real engines are read
back in test_engine.py, test_engine_tensor_parallel.py and the end-to-end runs with --vllm_sync_check)."""

from __future__ import annotations

import pytest
import torch

from openppo.rollout.readback import Shard, check_engine_weights, from_bytes, to_bytes


def _trainer() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "embed.weight": torch.randn(10, 4, generator=g),
        "q.weight": torch.randn(6, 4, generator=g),
        "o.weight": torch.randn(4, 6, generator=g),
        "norm.weight": torch.randn(4, generator=g),
    }


def _tp2_engine(w: dict[str, torch.Tensor]) -> list[list[Shard]]:
    """Two workers: vocabulary rows and column-parallel rows split on dim 0, row-parallel on dim 1, norms whole; an
    LM head tied to the embedding."""
    return [
        [
            Shard("embed.weight", 0, 5 * r, w["embed.weight"][5 * r : 5 * r + 5]),
            Shard("lm_head.weight", 0, 5 * r, w["embed.weight"][5 * r : 5 * r + 5], tied_to="embed.weight"),
            Shard("q.weight", 0, 3 * r, w["q.weight"][3 * r : 3 * r + 3]),
            Shard("o.weight", 1, 3 * r, w["o.weight"][:, 3 * r : 3 * r + 3]),
            Shard("norm.weight", None, 0, w["norm.weight"]),
        ]
        for r in range(2)
    ]


def _perturbed(engine: list[list[Shard]], worker: int, name: str, index: tuple[int, ...]) -> list[list[Shard]]:
    """The engine with 0.5 added at `index` of worker `worker`'s local slice of `name`."""
    out = [list(shards) for shards in engine]
    for i, s in enumerate(out[worker]):
        if s.name == name:
            tensor = s.tensor.clone()
            tensor[index] += 0.5
            out[worker][i] = s._replace(tensor=tensor)
    return out


def test_equal_slices_pass_and_every_difference_is_named():
    w = _trainer()
    check = check_engine_weights(w.items(), _tp2_engine(w))
    assert check.ok(), check.summary()
    assert set(check.rel_diff) == set(w) | {"lm_head.weight"}  # the tied head is compared with the embedding
    assert max(check.rel_diff.values()) == 0.0

    # a column of o held by worker 1, a row of the tied LM head, the norm copy of worker 1
    for worker, name, index, full in [
        (1, "o.weight", (2, 1), "o.weight"),
        (1, "lm_head.weight", (2, 1), "embed.weight"),
        (1, "norm.weight", (3,), "norm.weight"),
    ]:
        check = check_engine_weights(w.items(), _perturbed(_tp2_engine(w), worker, name, index))
        assert not check.ok() and check.worst()[0] == name, (name, check.summary())
        assert check.worst()[1] == pytest.approx(0.5 / w[full].abs().max().item(), rel=1e-6)
        assert name in check.summary()


def test_missing_uncovered_unexpected_and_misshapen():
    w = _trainer()
    engine = _tp2_engine(w)
    engine[1] = [s for s in engine[1] if s.name != "q.weight"]  # rows 3-5 of q held by no worker
    engine[0].append(Shard("extra.weight", None, 0, torch.zeros(2)))
    check = check_engine_weights(w.items(), engine)
    assert not check.ok()
    assert check.missing == ["q.weight"] and check.unexpected == ["extra.weight"]

    del w["norm.weight"]  # the trainer has no such tensor: the engine's is unexpected
    assert check_engine_weights(w.items(), _tp2_engine(_trainer())).unexpected == ["norm.weight"]

    w = _trainer()
    bad = [
        [s if s.name != "q.weight" else s._replace(tensor=s.tensor[:, :3]) for s in shards] for shards in _tp2_engine(w)
    ]
    assert check_engine_weights(w.items(), bad).rel_diff["q.weight"] == float("inf")


def test_engine_dtype_allows_one_rounding():
    """A bf16 engine holds the trainer's fp32 tensors rounded to bf16: the comparison rounds the trainer's too."""
    w = _trainer()
    engine = [[s._replace(tensor=s.tensor.bfloat16()) for s in shards] for shards in _tp2_engine(w)]
    check = check_engine_weights(w.items(), engine)
    assert check.ok() and check.rtol == torch.finfo(torch.bfloat16).eps
    assert check.worst()[1] == 0.0


def test_bytes_round_trip():
    shards = _tp2_engine(_trainer())[1]
    back = from_bytes(to_bytes(shards))
    assert [s[:3] + s[4:] for s in back] == [s[:3] + s[4:] for s in shards]
    assert all(torch.equal(a.tensor, b.tensor) for a, b in zip(back, shards))
