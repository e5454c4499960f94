"""Micro-batch planning and rank balancing by tokens (pure)."""

from __future__ import annotations

import random

import pytest
import torch

from openppo.ppo.batching import Batching, balanced_shards, cost, equalize, split_by_tokens


def test_cost_of_packed_and_padded_rows():
    assert cost([3, 10, 5], packed=True) == 18
    assert cost([3, 10, 5], packed=False) == 30
    assert cost([], packed=True) == 0


def test_token_budget_fills_in_order_and_never_exceeds_except_single_rows():
    lengths = [5, 17, 9, 30, 12, 3, 22, 8]
    for packed in (True, False):
        micros = split_by_tokens(lengths, 40, packed)
        assert [i for m in micros for i in m] == list(range(len(lengths)))
        for m in micros:
            assert len(m) == 1 or cost([lengths[i] for i in m], packed) <= 40
    assert split_by_tokens(lengths, 40, packed=True) == [[0, 1, 2], [3], [4, 5, 6], [7]]
    assert split_by_tokens([50, 2], 10, packed=True) == [[0], [1]]  # an over-budget row goes alone


def test_static_plan_is_a_row_count():
    assert Batching(rows=3).plan([1] * 7) == [[0, 1, 2], [3, 4, 5], [6]]


def test_equalize_splits_costliest_then_pads_with_empty():
    lengths = [5, 17, 9, 30]
    micros = [[0, 1, 2], [3]]
    out = equalize(micros, lengths, 3, packed=True)
    assert out == [[0], [1, 2], [3]] and [i for m in out for i in m] == [0, 1, 2, 3]
    assert equalize([[0], [1]], [4, 4], 4, packed=True) == [[0], [1], [], []]
    assert equalize(micros, lengths, 2, packed=True) == micros


def test_balanced_shards_even_out_tokens():
    rng = random.Random(0)
    lengths = [rng.randint(8, 512) for _ in range(64)]
    shards = balanced_shards(lengths, 4)
    assert sorted(i for s in shards for i in s) == list(range(64))
    assert all(len(s) == 16 and s == sorted(s) for s in shards)
    totals = [sum(lengths[i] for i in s) for s in shards]
    contiguous = [sum(lengths[i * 16 : (i + 1) * 16]) for i in range(4)]
    assert max(totals) - min(totals) <= max(lengths)
    assert max(totals) - min(totals) < max(contiguous) - min(contiguous)


def test_forward_batches_that_do_not_divide_are_dealt_unevenly_and_reassembled():
    from openppo.ppo.batching import in_batch_order, shard_rows, shards

    # 10 rows over 3 reference ranks: 4, 3, 3 rows; contiguous and by tokens
    data = {
        "sequences": torch.arange(10).unsqueeze(1).repeat(1, 4),
        "attention_mask": torch.tensor([[1, 1, 1, 1]] * 3 + [[1, 0, 0, 0]] * 7),
    }
    for balance in (False, True):
        rows = shard_rows(data, 3, balance)
        assert sorted(len(r) for r in rows) == [3, 3, 4] and sorted(i for r in rows for i in r) == list(range(10))
        # each rank returns a per-row value computed from its own rows: back in batch order it is the row index
        results = [data["sequences"][torch.tensor(r)][:, 0].float() * 2 for r in rows]
        assert in_batch_order(results, rows).tolist() == [2.0 * i for i in range(10)]
    with pytest.raises(ValueError, match="cannot be dealt to 11 ranks"):
        shard_rows(data, 11, False)
    # training shards stay equal: a batch that does not divide is a bug upstream of validation
    with pytest.raises(ValueError, match="does not split over 3 data-parallel ranks"):
        shards(data, 3)
    assert [len(s["sequences"]) for s in shards(data, 4, replicas=2)] == [5, 5, 5, 5]


def test_shared_prompts_cost_once_and_groups_are_dealt_whole():
    from openppo.ppo.batching import group_shards, prompt_groups, prompt_shares
    from openppo.ppo.fit import shuffled
    from tests.ppo.rank_helpers import grouped_rows

    data = grouped_rows([(20, [3, 5]), (30, [2, 2]), (10, [8, 1]), (25, [4, 4])])
    shares = prompt_shares(data)
    assert shares == [0, 20, 0, 30, 0, 10, 0, 25]
    lengths = [23, 25, 32, 32, 18, 11, 29, 29]
    assert cost(lengths[:2], packed=True, shares=shares[:2]) == 28  # the prompt once, two responses
    assert cost(lengths[1:3], packed=True, shares=shares[1:3]) == 57  # a micro-batch starting mid-group pays it
    # a 62-token budget: two groups fit where a shared prompt counts once (62 and 52 tokens)
    assert split_by_tokens(lengths, 62, packed=True, shares=shares) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert split_by_tokens(lengths, 62, packed=True) == [[0, 1], [2], [3, 4, 5], [6, 7]]
    # 2 ranks get 2 whole groups each, the token totals (28 + 34, 19 + 33) evened out
    shards = group_shards(data, 2)
    assert sorted(map(sorted, shards)) == [[0, 1, 6, 7], [2, 3, 4, 5]]
    assert group_shards(data, 3) is None  # 4 groups do not split over 3 ranks: rows are dealt one by one
    # an update's shuffle moves whole groups and keeps each group's rows in order
    assert prompt_groups(prompt_shares(data)) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    order = shuffled([[0, 1], [2, 3], [4, 5], [6, 7]], seed=3)
    assert sorted(order) == list(range(8)) and all(order[i] + 1 == order[i + 1] for i in range(0, 8, 2))
    assert (
        shuffled(prompt_groups([0] * 8), seed=3)
        == torch.randperm(8, generator=torch.Generator().manual_seed(3)).tolist()
    )
