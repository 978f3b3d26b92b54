"""Fixed-size page allocator for the shared pool: a numpy free stack, O(1) vectorised alloc and free.

Blocks of any size share one pool: a block takes ceil(block_bytes / page_size) pages, which need not be
contiguous, so the only waste is the unused tail of each block's last page (no external fragmentation).
"""

from __future__ import annotations

import numpy as np


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        # Stack of free page ids; the top is the end. Reversed so that fresh pools hand out ascending ids.
        self._stack = np.arange(num_pages - 1, -1, -1, dtype=np.uint32)
        self._top = num_pages
        self._allocated = np.zeros(num_pages, dtype=bool)

    @property
    def free_pages(self) -> int:
        return self._top

    @property
    def used_pages(self) -> int:
        return self.num_pages - self._top

    def allocate(self, count: int) -> np.ndarray | None:
        """Take `count` pages; None (and nothing taken) when fewer are free."""
        if count > self._top:
            return None
        pages = self._stack[self._top - count : self._top][::-1].copy()
        self._top -= count
        self._allocated[pages] = True
        return pages

    def release(self, pages: np.ndarray) -> None:
        pages = np.asarray(pages, dtype=np.uint32)
        if pages.size == 0:
            return
        if not self._allocated[pages].all() or np.unique(pages).size != pages.size:
            raise RuntimeError("page released twice or never allocated")
        self._allocated[pages] = False
        self._stack[self._top : self._top + pages.size] = pages[::-1]
        self._top += pages.size
