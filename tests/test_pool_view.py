"""PageView's gather and scatter between block buffers and pool pages, and a client's PoolMapping."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from kvtier.pool_view import PageView, PoolMapping

PAGE = 4096


@pytest.mark.parametrize("block_bytes", [3 * PAGE, 3 * PAGE + 100])  # whole pages; a partial last page
def test_read_blocks_gathers_into_strided_rows(block_bytes):
    view = PageView(bytearray(64 * PAGE), PAGE)
    rng = np.random.default_rng(1)
    per_block = -(-block_bytes // PAGE)
    page_ids = rng.permutation(64)[: 5 * per_block].astype("<u4").reshape(5, per_block)
    data = rng.integers(0, 256, (5, block_bytes), dtype=np.uint8)
    view.write_blocks(page_ids, data)
    assert np.array_equal(view.read_blocks(page_ids, block_bytes), data)
    staging = np.zeros((5, 4 * PAGE + 512), dtype=np.uint8)  # rows longer than a block, as demotion's buffers
    view.read_blocks(page_ids, block_bytes, out=staging[:, :block_bytes])
    assert np.array_equal(staging[:, :block_bytes], data) and not staging[:, block_bytes:].any()


def test_read_blocks_refuses_a_page_outside_the_pool():
    view = PageView(bytearray(8 * PAGE), PAGE)
    with pytest.raises(IndexError, match="page id 8 outside"):
        view.read_blocks(np.array([[1, 8]], dtype="<u4"), 2 * PAGE)


def test_block_buffers_are_one_per_run_of_consecutive_pages():
    view = PageView(bytearray(64 * PAGE), PAGE)
    view.pages[:] = np.arange(64, dtype=np.uint8)[:, None]  # each page filled with its id
    block_pages = np.array([7, 8, 9, 3, 4, 20], dtype="<u4")
    buffers = view.block_buffers(block_pages)
    assert [len(b) for b in buffers] == [3 * PAGE, 2 * PAGE, PAGE]
    joined = np.concatenate([np.frombuffer(b, dtype=np.uint8) for b in buffers])
    assert np.array_equal(joined, np.repeat(block_pages.astype(np.uint8), PAGE))
    np.frombuffer(buffers[1], dtype=np.uint8)[:] = 99  # the buffers are the pool's memory, not copies
    assert (view.pages[3:5] == 99).all() and (view.pages[[2, 5]] != 99).all()


def test_populating_a_pool_mapping_lets_the_engines_other_threads_run():
    """An engine maps the pool at start and after each reconnect; populating its pages takes a while
    (about 0.25 s a GiB), which its other threads (vLLM's) must not spend waiting for the GIL."""
    path = Path("/dev/shm") / f"kvtier-test-populate-{os.getpid()}"
    size = 512 << 20
    path.write_bytes(b"")
    os.truncate(path, size)
    mapping = PoolMapping(path, size, 32 << 10)
    counted, stop = [0], threading.Event()

    def count() -> None:
        while not stop.is_set():
            counted[0] += 1

    counter = threading.Thread(target=count)
    counter.start()
    try:
        time.sleep(0.05)
        start, before = time.perf_counter(), counted[0]
        time.sleep(0.1)
        rate = (counted[0] - before) / (time.perf_counter() - start)  # counts a second, the GIL free
        start, before = time.perf_counter(), counted[0]
        mapping.populate()
        elapsed, during = time.perf_counter() - start, counted[0] - before
    finally:
        stop.set()
        counter.join()
        mapping.close()
        path.unlink()
    assert elapsed > 0.02  # (long enough to tell)
    assert during > 0.5 * rate * elapsed
