"""bench/train_step_table.py's run list: what a GPU sitting runs, in which order, before its budget runs out."""

from __future__ import annotations

from bench.train_step_table import ORDER, VARIANTS, runs


def test_the_runs_go_in_order_and_the_larger_micro_batches_at_the_longest_rows_but_the_compiled_one():
    plan = runs([1024, 4096], list(ORDER))
    assert [v for v, _ in plan] == sorted((v for v, _ in plan), key=ORDER.index)  # the order of importance
    for variant in ORDER:
        lengths = [n for v, n in plan if v == variant]
        four_x = VARIANTS[variant][1] > 1
        # the compiled step with 32768 tokens a micro-batch is what a 1k-row GPU run gets by default
        assert lengths == ([4096] if four_x and variant != "compile 4x micro" else [1024, 4096]), variant
    assert plan[:5] == [("plain", 1024), ("plain", 4096), ("compile", 1024), ("compile", 4096), (ORDER[2], 1024)]
    both = [("plain", 1024), ("plain", 4096), ("Liger", 1024), ("Liger", 4096)]
    assert runs([1024, 4096], ["Liger", "plain"]) == both
