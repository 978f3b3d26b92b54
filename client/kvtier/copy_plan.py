"""Where every byte of a batch of blocks goes between an engine's GPU KV cache and the pool.

An engine describes its cache as runs (`KVRun`): block b's k-th run is `size` bytes at
`allocation + offset + b * block_stride`, and a block's bytes in the pool are its runs concatenated.
The pool stores a block in pages of `page_size` bytes. Cutting the block's byte range at every run
boundary and every page boundary gives segments that are contiguous on both sides; their shape is the
same for every block, so it is computed once per registration (`SegmentTemplate`), and the copy
kernel (one program per segment of each block) works out the addresses from it, the block id and
the block's pages (segment k of GPU block b in pool pages p: GPU `base[allocation] + gpu_offset +
b * block_stride`, pool `pool_base + p[page] * page_size + page_offset`); no Python loop over blocks
or segments. The copy kernel runs one program per segment; the copy engines take runs:
whole blocks that are one stretch in the pool (`pool_stretches`) and, for block-outermost caches, on
the GPU (`gpu_stretches`), merged where they continue each other (`coalesce`: blocks in consecutive
pool pages give one run per stretch of consecutive blocks); for other caches, blocks that follow
each other on both sides move one run of a block at a time, as 2-D copies of a row per block
(`strided_runs`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

WORD = 8  # segments move and checksum 64-bit words


@dataclass(frozen=True)
class Run:
    allocation: int
    offset: int
    block_stride: int
    size: int


@dataclass(frozen=True)
class SegmentTemplate:
    """Per segment of one block (arrays of equal length)."""

    allocation: np.ndarray  # int64: which allocation the GPU side is in
    gpu_offset: np.ndarray  # int64: bytes from the allocation base for block 0
    block_stride: np.ndarray  # int64: GPU bytes between consecutive blocks
    page: np.ndarray  # int64: which of the block's pool pages
    page_offset: np.ndarray  # int64
    words: np.ndarray  # int64: segment length in 64-bit words
    first_word: np.ndarray  # int64: position of the segment's first word in the block (checksum weights)
    runs: np.ndarray  # int64 [5, runs]: each run's allocation, offset, block_stride, size, position in the block

    @classmethod
    def build(cls, runs: list[Run], page_size: int) -> SegmentTemplate:
        if not runs:
            raise ValueError("a KV cache needs at least one run")
        if page_size % WORD:
            raise ValueError(f"page size {page_size} is not a multiple of {WORD}")
        for run in runs:
            if run.size <= 0 or run.size % WORD or run.offset % WORD or run.block_stride % WORD:
                raise ValueError(f"run {run} is not made of whole, aligned {WORD}-byte words")
        sizes = np.array([r.size for r in runs], dtype=np.int64)
        run_start = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        block_bytes = int(sizes.sum())
        cuts = np.union1d(run_start, np.arange(0, block_bytes, page_size, dtype=np.int64))
        length = np.diff(np.append(cuts, block_bytes))
        run_of = np.searchsorted(run_start, cuts, side="right") - 1
        offsets = np.array([r.offset for r in runs], dtype=np.int64)
        return cls(
            allocation=np.array([r.allocation for r in runs], dtype=np.int64)[run_of],
            gpu_offset=offsets[run_of] + cuts - run_start[run_of],
            block_stride=np.array([r.block_stride for r in runs], dtype=np.int64)[run_of],
            page=cuts // page_size,
            page_offset=cuts % page_size,
            words=length // WORD,
            first_word=cuts // WORD,
            runs=np.vstack([np.array([[r.allocation, r.offset, r.block_stride, r.size] for r in runs]).T, run_start]),
        )

    @property
    def block_bytes(self) -> int:
        return int(self.words.sum()) * WORD

    @property
    def one_run(self) -> bool:
        """A block is one run of GPU memory (block-outermost layouts)."""
        return self.runs.shape[1] == 1

    @property
    def narrowest_run(self) -> int:
        return int(self.runs[3].min())

    def strided_runs(self, allocation_bases: np.ndarray, first_block: int, pool_stretch: int) -> StridedRuns:
        """How blocks first_block, first_block + 1, ... held in pool stretches from `pool_stretch` on
        move one run at a time: per run, a 2-D copy with a row per block."""
        allocation, offset, stride, size, position = self.runs
        return StridedRuns(allocation_bases[allocation] + offset + first_block * stride, stride, pool_stretch + position, size)

    def gpu_stretches(self, allocation_bases: np.ndarray, block_ids: np.ndarray) -> np.ndarray | None:
        """GPU address of each whole block ([n_blocks] int64) when a block is one run of GPU memory
        (block-outermost layouts); None otherwise."""
        if not self.one_run:
            return None
        return allocation_bases[self.allocation[0]] + self.gpu_offset[0] + block_ids.astype(np.int64) * self.block_stride[0]

    def pool_stretches(self, pool_base: int, page_ids: np.ndarray, page_size: int) -> np.ndarray | None:
        """Pool address of each whole block ([n_blocks] int64) when each block's pages are consecutive
        (as the pool hands them out unless it is fragmented): its bytes are then one stretch; None
        otherwise."""
        pages = page_ids.astype(np.int64)
        if (pages[:, 1:] != pages[:, :-1] + 1).any():
            return None
        return pool_base + pages[:, 0] * page_size


@dataclass(frozen=True)
class StridedRuns:
    """Per run of a block ([runs] int64): where it is in the first block on the GPU, the GPU bytes
    between blocks, where it is in the first block's pool stretch, and its bytes (a row's width)."""

    gpu: np.ndarray
    gpu_pitch: np.ndarray
    pool: np.ndarray
    width: np.ndarray


def follow_each_other(block_ids: np.ndarray, page_ids: np.ndarray) -> bool:
    """The blocks follow each other on both sides: GPU ids one apart, and all their pool pages
    ([blocks, pages per block]) one apart (each block one stretch of the pool, the next right after)."""
    return _steps_of_one(block_ids) and _steps_of_one(page_ids.ravel())


def _steps_of_one(ids: np.ndarray) -> bool:
    """ids[i + 1] == ids[i] + 1 throughout (the ends compared as Python ints, so that no wrap-around of
    unsigned page ids passes)."""
    return len(ids) < 2 or (int(ids[-1]) - int(ids[0]) == len(ids) - 1 and bool((ids[1:] - ids[:-1] == 1).all()))


class LaunchFailed(Exception):
    """Enqueueing a copy failed after part of it was enqueued (its cause is the error). `enqueued` (a
    gpu_copy.LaunchedCopy) is done once that part has landed: only then may the copy's pages be freed
    or its mappings closed. Here rather than in gpu_copy so that code without torch can catch it."""

    def __init__(self, enqueued) -> None:
        super().__init__("a copy failed after part of it was enqueued")
        self.enqueued = enqueued


def coalesce(src: np.ndarray, dst: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(src, dst, sizes) of the runs made by merging each segment into the one before it when it
    continues it on both sides."""
    if len(src) == 0:
        return src, dst, sizes
    starts = np.ones(len(src), dtype=bool)
    starts[1:] = (src[1:] != src[:-1] + sizes[:-1]) | (dst[1:] != dst[:-1] + sizes[:-1])
    first = np.flatnonzero(starts)
    return src[first], dst[first], np.add.reduceat(sizes, first)
