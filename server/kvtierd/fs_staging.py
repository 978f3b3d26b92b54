"""Staging buffers: aligned buffers that hold blocks' bytes until their files are written, reused.

Demoted and written-through blocks' bytes wait in them until written, reused from one write to the
next.

Reuse matters because first-touching fresh memory is slow (page faults, and in a VM the host backing
the guest's pages: 1-2 s per GiB measured on a 2-core VM, slower than the disk), while copying into
memory touched before runs at memcpy speed. StagingBuffers are kept by size; `queued` (buffers in use)
plus `kept` (free buffers) stay within the limit (--fs-queue-size), so that is the most staging memory
the fs tier holds.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from kvtierd.fs_format import aligned_empty


class StagingBuffers:
    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.queued = 0  # bytes of buffers handed out and not yet given back
        self.kept = 0  # bytes of free buffers kept for reuse
        self._free: dict[int, list[np.ndarray]] = defaultdict(list)

    def room(self, size: int) -> int:
        """How many more buffers of `size` bytes may be handed out."""
        return max(0, (self.limit - self.queued) // size)

    def take(self, size: int) -> np.ndarray:
        """An ALIGN-aligned buffer of `size` bytes (contents undefined)."""
        free = self._free[size]
        if free:
            self.kept -= size
            buffer = free.pop()
        else:
            self._drop_kept(size)
            buffer = aligned_empty(size)
        self.queued += size
        return buffer

    def _drop_kept(self, size: int) -> None:
        """Free kept buffers (of other sizes) until `size` more bytes fit the limit."""
        for kept_size, buffers in self._free.items():
            while buffers and self.queued + self.kept + size > self.limit:
                buffers.pop()
                self.kept -= kept_size

    def give_back(self, buffer: np.ndarray) -> None:
        size = len(buffer)
        self.queued -= size
        if self.queued + self.kept + size <= self.limit:
            self._free[size].append(buffer)
            self.kept += size
