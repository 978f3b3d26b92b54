"""Vectorised block copies between contiguous block buffers and the paged shared pool.

A block of `block_bytes` occupies `pages_per_block` pages; its byte k*page_size + j lives at byte j of
its k-th page. Both the daemon (inline transport) and clients (shm transport) copy through here, with
one numpy gather/scatter per batch and no Python loop over blocks.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
from pathlib import Path

import numpy as np

log = logging.getLogger("kvtier.pool")


def decode_page_ids(page_ids: bytes, pages_per_block: int) -> np.ndarray:
    ids = np.frombuffer(page_ids, dtype="<u4")
    if ids.size % pages_per_block:
        raise ValueError(f"{ids.size} page ids do not split into blocks of {pages_per_block} pages")
    return ids.reshape(-1, pages_per_block)


class PageView:
    """A uint8 [num_pages, page_size] view of pool memory."""

    def __init__(self, buffer, page_size: int) -> None:
        flat = np.frombuffer(buffer, dtype=np.uint8)
        self.page_size = page_size
        self.pages = flat[: flat.size // page_size * page_size].reshape(-1, page_size)

    def write_blocks(self, page_ids: np.ndarray, data: np.ndarray) -> None:
        """Scatter `data` [n, block_bytes] into the pages `page_ids` [n, pages_per_block]."""
        n, block_bytes = data.shape
        full, tail = divmod(block_bytes, self.page_size)
        if full:
            self.pages[page_ids[:, :full]] = data[:, : full * self.page_size].reshape(n, full, self.page_size)
        if tail:
            self.pages[page_ids[:, full], :tail] = data[:, full * self.page_size :]

    def read_blocks(self, page_ids: np.ndarray, block_bytes: int, out: np.ndarray | None = None) -> np.ndarray:
        """Gather blocks into `out` [n, block_bytes] (allocated when None)."""
        n = page_ids.shape[0]
        if out is None:
            out = np.empty((n, block_bytes), dtype=np.uint8)
        full, tail = divmod(block_bytes, self.page_size)
        if page_ids.size and int(page_ids.max()) >= len(self.pages):
            raise IndexError(f"page id {int(page_ids.max())} outside the pool's {len(self.pages)} pages")
        if full:  # straight into `out`: no temporary (fresh memory is slow to touch), and "clip" is unbuffered
            np.take(self.pages, page_ids[:, :full], axis=0, out=out[:, : full * self.page_size].reshape(n, full, -1), mode="clip")
        if tail:
            out[:, full * self.page_size :] = self.pages[page_ids[:, full], :tail]
        return out

    def block_buffers(self, block_pages: np.ndarray) -> list[memoryview]:
        """One block's pages as buffers, in order: one per run of consecutive pages (as the pool hands
        them out unless it is fragmented). An O_DIRECT read into one buffer per 32 KiB page ran at
        0.70-0.82 of one into the same bytes as one buffer on a virtio disk."""
        breaks = (np.flatnonzero(np.diff(block_pages.astype(np.int64)) != 1) + 1).tolist()
        bounds = zip([0, *breaks], [*breaks, len(block_pages)], strict=True)
        return [memoryview(self.pages[int(block_pages[a]) : int(block_pages[a]) + b - a].reshape(-1)) for a, b in bounds]

    def write_range(self, block_pages: np.ndarray, offset: int, data: bytes) -> None:
        """Write `data` at byte `offset` of one block (pages `block_pages`)."""
        src = np.frombuffer(data, dtype=np.uint8)
        position = 0
        while position < src.size:
            page, start = divmod(offset + position, self.page_size)
            length = min(self.page_size - start, src.size - position)
            self.pages[block_pages[page], start : start + length] = src[position : position + length]
            position += length


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


class PoolMapping:
    """A client's read-write mapping of the daemon's pool file (shm transport)."""

    def __init__(self, path: str | Path, size: int, page_size: int) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            self._mmap = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.view = PageView(self._mmap, page_size)
        self._cuda = None  # a CudaHostRegistration once a GPU engine copies with its own kernel

    def cuda_address(self) -> int:
        """The mapping's address, registered with CUDA (once) so GPU kernels can read and write it."""
        address = self.view.pages.ctypes.data
        if self._cuda is None:
            from kvtier.cuda_host import CudaHostRegistration  # noqa: PLC0415 (GPU engines only)

            self.populate()
            self._cuda = CudaHostRegistration(address, self.view.pages.nbytes)
        if not self._cuda.active:  # not an OSError: that would read as the daemon being gone
            raise RuntimeError("cudaHostRegister of the pool mapping failed")
        return address

    def populate(self) -> None:
        """Map every page now (MADV_POPULATE_WRITE), so copies later take no page faults. Through libc,
        which lets go of the GIL (mmap.madvise keeps it: a pool of 12 GiB held every other thread of the
        engine for 3 s); on older kernels it fails, and pages fault in on first use instead."""
        _LIBC.madvise(self.view.pages.ctypes.data, self.view.pages.nbytes, _MADV_POPULATE_WRITE)

    def close(self) -> None:
        if self._cuda is not None:
            self._cuda.close()  # before the memory goes
        self.view = None  # type: ignore[assignment]
        try:
            self._mmap.close()
        except BufferError:  # numpy views still alive; the mapping goes with them
            log.info("kvtierd pool mapping still in use; it is unmapped when its last view goes")
