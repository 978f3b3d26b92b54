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
        self.queued -= len(buffer)
        self._keep(buffer)

    def spare(self, size: int) -> int:
        """How many more buffers of `size` bytes fit the limit beside those in use and kept."""
        return max(0, (self.limit - self.queued - self.kept) // size)

    def keep(self, buffers: list[np.ndarray]) -> None:
        """Buffers made ahead of need (`touched_buffers`), kept for `take` as far as the limit allows."""
        for buffer in buffers:
            self._keep(buffer)

    def _keep(self, buffer: np.ndarray) -> None:
        size = len(buffer)
        if self.queued + self.kept + size <= self.limit:
            self._free[size].append(buffer)
            self.kept += size


def touched_buffers(size: int, count: int) -> list[np.ndarray]:
    """`count` buffers of `size` bytes with every page written once: first touches are the slow part
    of fresh memory, so they are made on an I/O thread (the writes let the GIL go)."""
    buffers = [aligned_empty(size) for _ in range(count)]
    for buffer in buffers:
        buffer[:] = 0
    return buffers
