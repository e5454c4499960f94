"""`make test`'s two workers take files longest first (tests/conftest.py): a renamed or removed file in that list
would silently lose its place in the order."""

from __future__ import annotations

from tests.conftest import LONGEST_FIRST, REPO


def test_every_file_of_the_longest_first_order_exists():
    assert [path for path in LONGEST_FIRST if not (REPO / path).is_file()] == []
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)
