"""Staging buffers (demotion and write-through): aligned, reused, and never more than the queue limit in all."""

from __future__ import annotations

from kvtierd.fs_format import ALIGN
from kvtierd.fs_staging import StagingBuffers


def test_buffers_are_aligned_reused_and_bounded():
    staging = StagingBuffers(limit=3 * 8192)
    assert staging.room(8192) == 3
    first, second = staging.take(8192), staging.take(8192)
    assert first.ctypes.data % ALIGN == 0 and len(first) == 8192
    assert staging.room(8192) == 1 and staging.queued == 2 * 8192
    staging.give_back(first)
    again = staging.take(8192)
    assert again.ctypes.data == first.ctypes.data  # the same memory, touched before: no page faults
    staging.give_back(again)
    staging.give_back(second)
    assert (staging.queued, staging.kept) == (0, 2 * 8192)
    big = staging.take(2 * 8192)  # another size: a new buffer, and a kept one is freed to stay in the limit
    assert (staging.queued, staging.kept) == (2 * 8192, 8192)
    staging.give_back(big)
    assert (staging.queued, staging.kept) == (0, 3 * 8192)
    assert staging.take(2 * 8192).ctypes.data == big.ctypes.data
