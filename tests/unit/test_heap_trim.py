"""The heap trim runs at most once per interval: the pages it hands back cost the next update their refaults."""

from __future__ import annotations

import ctypes.util

import pytest

from openppo.utils import hardware


@pytest.mark.skipif(ctypes.util.find_library("c") is None, reason="no C library to trim")
def test_trim_is_rate_limited(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(hardware.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(hardware, "_last_trim", None)
    assert not hardware.trim_host_heap(min_interval_s=60.0)  # the first call starts the clock
    clock[0] += 59.0
    assert not hardware.trim_host_heap(min_interval_s=60.0)  # too soon
    clock[0] += 1.0
    assert hardware.trim_host_heap(min_interval_s=60.0)  # a minute after the first call
    clock[0] += 30.0
    assert not hardware.trim_host_heap(min_interval_s=60.0)  # too soon after that trim
    assert hardware.trim_host_heap(min_interval_s=0.0)  # no limit: always
    monkeypatch.setattr(hardware, "_last_trim", None)
    assert hardware.trim_host_heap(min_interval_s=0.0)  # also on the first call
