"""PageView's gather and scatter between block buffers and pool pages."""

from __future__ import annotations

import numpy as np
import pytest

from kvtier.pool_view import PageView

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
