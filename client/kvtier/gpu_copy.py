"""One batch of blocks between GPU memory and the pinned pool, copied and checksummed.

Two engines move bytes. The copy kernel (Triton) runs one program per segment of a block (see
copy_plan), copying 64-bit words between any two addresses the GPU can reach (the engine's KV cache
opened through CUDA IPC, the pool registered with cudaHostRegister, read and written over PCIe, or
GPU memory) and adding up the checksum while the words pass through registers; over PCIe it reaches
about 0.92 of a bulk memcpy. The copy engines (cuda_dma) reach about 0.98, for runs of 1 MiB or
more.

A cache's segment template lives on its GPU (`GpuLayout`, sent once): a call sends only its block
ids and pool page ids, which the kernel reads straight from pinned host memory, working out every
segment's addresses itself, and it writes the partial checksums back there. Python's work per call
is therefore a few array fills and launches, whatever the number of segments.

Stores go through the kernel (with four stores in flight on an H200, DMA from the GPU to the pool
reached 39-49 GB/s where the kernel reached 50-52). A load goes through the copy engines straight
into place, in chunks (`_chunk_starts`): a small first one, enqueued as soon as its copies are known
(its bytes move while the rest is planned), the bulk, then two that shrink about twelvefold each.
Blocks that follow each other on both sides (GPU ids and pool pages one apart: a prefix loaded into
a fresh cache) are recognised once per load, and each of their chunks is then worked out with a few
integers (`_following_blocks`: on the H200's host each numpy call before the first byte costs 3-10
us): one copy into a block-outermost cache (BLHNC) whose blocks fill their pages, else one 2-D copy
per run of a block (per layer, into a layer-major LBHNC cache) with a row per block. Into a BLHNC
cache other chunks move as runs of whole blocks (merged where consecutive, one driver call). The
kernel adds up each chunk's checksums in HBM on a second stream while the next, smaller chunk still
moves (HBM is some fifteen times faster than PCIe), so only a block or so's pass follows the last
byte. Into an LBHNC cache, only chunks of blocks that follow each other go to the copy engines;
each 2-D copy costs the copy engines about 3 us beyond its bytes, so every chunk holds
DMA_MIN_STRIDED_BYTES per copy or more (64 blocks of 64 KiB layers: a load of fewer than twice that
is one chunk, and its whole checksum pass follows the last byte). A chunk
the copy engines do not suit (a fragmented pool, scattered blocks of a layer-major cache, too few
bytes) goes through the kernel instead.
Each block's checksum is kvtier.checksum's (each word times the splitmix64 weight of its position in
the block), so stores get their checksums and loads their verification.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from kvtier import checksum, cuda_dma
from kvtier.copy_plan import LaunchFailed, Run, SegmentTemplate, StridedRuns, coalesce, follow_each_other

WORDS_PER_STEP = 1024  # 8 KiB per loop iteration of a program
DMA_MIN_MEAN_RUN_BYTES = 1 << 20  # below this, per-copy costs make DMA slower than the kernel
DMA_MIN_STRIDED_BYTES = 4 << 20  # the same for 2-D copies (about 3 us of the copy engines' time each)
TAIL_SHARE = 12  # each chunk of a DMA load holds about 1/TAIL_SHARE of the blocks before it
HEAD_BYTES = 8 << 20  # a DMA load's first chunk (about 0.15 ms at 55 GB/s, while the rest is planned)
TO_POOL, FROM_POOL, CHECK_IN_PLACE = 0, 1, 2  # what the kernel does with each segment
MAX_GRID_BLOCKS = 65535  # CUDA's limit on a grid's second dimension: blocks per launch


@triton.jit(do_not_specialize=["segment_count", "block_ids", "pages", "sums", "pages_per_block", "pool", "page_size", "first"])
def _copy_blocks(
    segments,  # [6, segment_count] int64 on the device: GpuLayout.segments
    segment_count,
    block_ids,  # address of int64 [blocks]: the GPU block ids
    pages,  # address of int64 [blocks, pages_per_block]: each block's pool pages
    sums,  # address of int64 [blocks, segment_count]: each segment's partial checksum, written here
    pages_per_block,
    pool,  # the pool's address
    page_size,
    first,  # the first block of this launch
    STEP: tl.constexpr,
    MODE: tl.constexpr,
):
    s = tl.program_id(0)
    block = first + tl.program_id(1)
    gpu_block = tl.load(block_ids.to(tl.pointer_type(tl.int64)) + block)
    gpu = tl.load(segments + s) + gpu_block * tl.load(segments + segment_count + s)
    page = tl.load(pages.to(tl.pointer_type(tl.int64)) + block * pages_per_block + tl.load(segments + 2 * segment_count + s))
    other = pool + page * page_size + tl.load(segments + 3 * segment_count + s)
    count = tl.load(segments + 4 * segment_count + s)
    position = tl.load(segments + 5 * segment_count + s).to(tl.uint64)
    if MODE == 1:
        src, dst = other, gpu
    else:
        src, dst = gpu, other
    src = src.to(tl.pointer_type(tl.uint64))
    dst = dst.to(tl.pointer_type(tl.uint64))
    lanes = tl.arange(0, STEP)
    total = tl.zeros([STEP], dtype=tl.uint64)
    for start in range(0, count, STEP):
        index = start + lanes
        inside = index < count
        words = tl.load(src + index, mask=inside, other=0)
        if MODE != 2:
            tl.store(dst + index, words, mask=inside)
        z = (position + index.to(tl.uint64) + 1) * 0x9E3779B97F4A7C15
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB
        z = (z ^ (z >> 31)) | 1
        total += words * z
    tl.store(sums.to(tl.pointer_type(tl.uint64)) + block * segment_count + s, tl.sum(total, axis=0))


@dataclass(frozen=True)
class GpuLayout:
    """A KV cache's segment template (for one pool page size) and allocation bases, with the template
    on the cache's GPU: per segment, its GPU address in block 0, GPU bytes between blocks, page of the
    block, offset in that page, length in words and first word's position in the block; and block
    0's runs as 2-D copies' first rows (`rows`, for loads of blocks that follow each other)."""

    template: SegmentTemplate
    bases: np.ndarray  # int64 device address of each allocation
    page_size: int
    segments: torch.Tensor  # [6, segments] int64 on the device
    block_bytes: int
    rows: StridedRuns | None  # block 0's runs as the first rows of 2-D copies (pool side: from its stretch);
    # None when they do not suit 2-D copies (a pitch beyond the driver's limit, or rows wider than their
    # pitch: blocks that overlap, which the driver refuses)

    @classmethod
    def on(cls, template: SegmentTemplate, bases: np.ndarray, page_size: int, device: torch.device) -> GpuLayout:
        t = template
        rows = np.stack([bases[t.allocation] + t.gpu_offset, t.block_stride, t.page, t.page_offset, t.words, t.first_word])
        segments = torch.from_numpy(rows.astype(np.int64)).to(device)
        first_rows = t.strided_runs(bases, 0, 0)
        if first_rows.gpu_pitch.max() > cuda_dma.MAX_PITCH or (first_rows.width > first_rows.gpu_pitch).any():
            first_rows = None
        return cls(template, bases, page_size, segments, t.block_bytes, first_rows)

    @property
    def segment_count(self) -> int:
        return len(self.template.words)


@dataclass(frozen=True)
class CopyLane:
    """Where copies run on one GPU: a stream for the copy engines and one for the kernel."""

    device: torch.device
    dma: torch.cuda.Stream
    kernel: torch.cuda.Stream

    @classmethod
    def on(cls, device: torch.device) -> CopyLane:
        return cls(device, torch.cuda.Stream(device), torch.cuda.Stream(device))


@dataclass
class LaunchedCopy:
    """A batch enqueued on its lane; `wait` returns the blocks' checksums once it is done."""

    done: torch.cuda.Event | None  # None: nothing to wait for
    call: torch.Tensor  # pinned: block ids, pages, then the partial sums the kernel writes
    sums: np.ndarray  # [blocks, segments] view of the partial sums in `call`

    @classmethod
    def of_nothing(cls, done: torch.cuda.Event | None) -> LaunchedCopy:
        """A copy of no block, done when `done` is (at once for None)."""
        return cls(done, torch.empty(0, dtype=torch.int64), np.empty((0, 0), dtype=np.int64))

    def finished(self) -> bool:
        return self.done is None or self.done.query()

    def wait(self) -> np.ndarray:
        if self.done is not None:
            self.done.synchronize()  # this copy only: later batches on the same lane do not delay it
        return self.checksums()

    def checksums(self) -> np.ndarray:
        """The blocks' checksums, once `finished`."""
        return checksum.combine(self.sums.view(np.uint64).T)


@dataclass
class _Call:
    """One call's arrays in pinned memory, which the kernel reads and writes in place: block ids,
    pool pages, then the partial checksums."""

    memory: torch.Tensor
    blocks: int
    pages_per_block: int

    @classmethod
    def of(cls, layout: GpuLayout, block_ids: np.ndarray, page_ids: np.ndarray) -> _Call:
        n, pages_per_block = page_ids.shape
        memory = torch.empty(n * (1 + pages_per_block + layout.segment_count), dtype=torch.int64, pin_memory=True)
        fields = memory.numpy()
        fields[:n] = block_ids
        fields[n : n * (1 + pages_per_block)] = page_ids.ravel()
        return cls(memory, n, pages_per_block)

    @property
    def sums(self) -> np.ndarray:
        return self.memory.numpy()[self.blocks * (1 + self.pages_per_block) :].reshape(self.blocks, -1)

    def launch(self, layout: GpuLayout, pool_address: int, first: int, count: int, mode: int) -> None:
        """The kernel over blocks [first, first + count) of the call, on the current stream (a launch per
        MAX_GRID_BLOCKS blocks: the grid's second dimension)."""
        ids = self.memory.data_ptr()
        pages, sums = ids + 8 * self.blocks, ids + 8 * self.blocks * (1 + self.pages_per_block)
        segments = layout.segment_count
        for start in range(first, first + count, MAX_GRID_BLOCKS):
            blocks = min(MAX_GRID_BLOCKS, first + count - start)
            _copy_blocks[(segments, blocks)](
                layout.segments, segments, ids, pages, sums, self.pages_per_block, pool_address, layout.page_size, start,
                STEP=WORDS_PER_STEP, MODE=mode, num_warps=4,
            )  # fmt: skip


def launch_copy(
    layout: GpuLayout,
    block_ids: np.ndarray,
    pool_address: int,
    page_ids: np.ndarray,
    to_pool: bool,
    lane: CopyLane,
    after=None,
) -> LaunchedCopy:
    """Enqueue the copy of whole blocks between a GPU KV cache and pool pages (page_ids[i] holds
    block_ids[i]) on `lane`, after the event `after` (if any; stores); returns at once. A load's
    copy engines start before anything else is prepared. Should anything fail after something may
    have been enqueued, LaunchFailed goes up, with what was enqueued to wait for (the lane is not
    drained here: the daemon's event loop waits for it by polling, serving other calls meanwhile)."""
    block_ids = np.asarray(block_ids, dtype=np.int64)
    n = len(block_ids)
    if n == 0:
        return LaunchedCopy.of_nothing(None)
    call = None
    try:
        with torch.cuda.device(lane.device):
            plan = None if to_pool else _load_in_place(layout, block_ids, pool_address, page_ids, lane)
            call = _Call.of(layout, block_ids, page_ids)
            with torch.cuda.stream(lane.kernel):
                if after is not None:
                    lane.kernel.wait_event(after)
                for (first, end), landed in (plan or {(0, n): None}).items():
                    if landed is None:
                        call.launch(layout, pool_address, first, end - first, TO_POOL if to_pool else FROM_POOL)
                    else:
                        lane.kernel.wait_event(landed)
                        call.launch(layout, pool_address, first, end - first, CHECK_IN_PLACE)
            return LaunchedCopy(_recorded(lane.kernel), call.memory, call.sums)
    except Exception as exc:
        raise LaunchFailed(_lane_drained(lane, call)) from exc


def _load_in_place(
    layout: GpuLayout, block_ids: np.ndarray, pool_address: int, page_ids: np.ndarray, lane: CopyLane
) -> dict[tuple[int, int], torch.cuda.Event | None] | None:
    """Enqueue a load on the copy engines chunk by chunk (`_chunk_starts`), each chunk as soon as its
    copies are worked out, so the first bytes move while the rest is planned: per chunk (first block,
    end), the event of its landing, or None for a chunk the kernel is to copy. Blocks that all follow
    each other on both sides (a prefix loaded into a fresh cache) are looked at once, and each chunk
    is then worked out with a few integers (`_following_blocks`); other loads chunk by chunk
    (`_dma_chunk`, or `_following_blocks` per chunk for caches with several runs a block). None when
    the copy engines take no part (a driver without cuMemcpyBatchAsync, or no chunk they suit)."""
    n, template = len(block_ids), layout.template
    if not cuda_dma.available():
        return None
    if not template.one_run and (layout.rows is None or n * template.narrowest_run < DMA_MIN_STRIDED_BYTES):
        return None  # (most loads of such caches: no chunk could go to the copy engines; no array work)
    following = _following_blocks(layout, block_ids, pool_address, page_ids)
    if following is not None:
        chunk, min_blocks = functools.partial(following.enqueue, lane=lane), following.min_blocks
    elif template.one_run:
        chunk, min_blocks = functools.partial(_dma_chunk, layout, block_ids, pool_address, page_ids, lane), 1
    else:
        chunk = functools.partial(_strided_chunk, layout, block_ids, pool_address, page_ids, lane)
        min_blocks = -(-DMA_MIN_STRIDED_BYTES // template.narrowest_run)
    plan = {
        (first, end): chunk(first, end)
        for first, end in itertools.pairwise([*_chunk_starts(n, layout.block_bytes, min_blocks), n])
    }
    return plan if any(event is not None for event in plan.values()) else None


def _following_blocks(
    layout: GpuLayout, block_ids: np.ndarray, pool_address: int, page_ids: np.ndarray
) -> _LinearBlocks | _StridedBlocks | None:
    """How blocks that follow each other on both sides (copy_plan.follow_each_other) move: as one copy
    when a block is one run and the blocks continue each other on both sides (a block-outermost cache
    whose blocks fill their pages), else as one 2-D copy per run of a block. None when they do not
    follow each other, or when their runs do not suit 2-D copies (a pitch beyond the driver's limit,
    or rows wider than their pitch: blocks that overlap)."""
    if not follow_each_other(block_ids, page_ids):
        return None
    template, first_block = layout.template, int(block_ids[0])
    pool_span = page_ids.shape[1] * layout.page_size
    first_stretch = pool_address + int(page_ids[0, 0]) * layout.page_size
    if template.one_run:
        allocation, offset, stride, size, _ = template.runs[:, 0].tolist()
        if size == stride == pool_span:
            return _LinearBlocks(int(layout.bases[allocation]) + offset + first_block * stride, first_stretch, pool_span)
    if layout.rows is None or pool_span > cuda_dma.MAX_PITCH:
        return None
    return _StridedBlocks(layout.rows, first_block, first_stretch, pool_span)


@dataclass(frozen=True)
class _LinearBlocks:
    """Blocks one after another on both sides, without a gap: any of them move as one copy."""

    gpu: int  # the first block's address on the GPU
    pool: int  # and in the pool
    block_bytes: int  # (its block stride on the GPU and its pages' span in the pool too)

    @property
    def min_blocks(self) -> int:
        """The fewest blocks whose copy suits the copy engines (DMA_MIN_MEAN_RUN_BYTES)."""
        return -(-DMA_MIN_MEAN_RUN_BYTES // self.block_bytes)

    def enqueue(self, first: int, end: int, lane: CopyLane) -> torch.cuda.Event | None:
        """Enqueue blocks [first, end) on the copy engines: the event of their landing; None (nothing
        enqueued) for fewer than `min_blocks`."""
        if end - first < self.min_blocks:
            return None
        offset = first * self.block_bytes
        cuda_dma.copy_linear(self.gpu + offset, self.pool + offset, (end - first) * self.block_bytes, lane.dma.cuda_stream)
        return _recorded(lane.dma)


@dataclass(frozen=True)
class _StridedBlocks:
    """Blocks that follow each other on both sides: any of them move as one 2-D copy per run of a
    block, with a row per block (rows a run's block stride apart on the GPU, `pool_span` in the pool)."""

    runs: StridedRuns  # of block 0 (GpuLayout.rows)
    first_block: int  # the first of these blocks
    first_stretch: int  # its pool address
    pool_span: int

    @property
    def min_blocks(self) -> int:
        """The fewest blocks whose copies suit the copy engines: DMA_MIN_STRIDED_BYTES each, or
        DMA_MIN_MEAN_RUN_BYTES for the one copy of a block that is one run (a block-outermost cache
        whose blocks leave a tail of their last page unused: rows of a whole block)."""
        least = DMA_MIN_MEAN_RUN_BYTES if len(self.runs.width) == 1 else DMA_MIN_STRIDED_BYTES
        return -(-least // int(self.runs.width.min()))

    def enqueue(self, first: int, end: int, lane: CopyLane) -> torch.cuda.Event | None:
        """As _LinearBlocks.enqueue."""
        if end - first < self.min_blocks:
            return None
        runs = self.runs
        gpu = runs.gpu + (self.first_block + first) * runs.gpu_pitch
        pool = runs.pool + (self.first_stretch + first * self.pool_span)
        cuda_dma.copy_2d(gpu, runs.gpu_pitch, pool, self.pool_span, runs.width, end - first, lane.dma.cuda_stream)
        return _recorded(lane.dma)


def _dma_chunk(  # noqa: PLR0913
    layout: GpuLayout, block_ids: np.ndarray, pool_address: int, page_ids: np.ndarray, lane: CopyLane, first: int, end: int
) -> torch.cuda.Event | None:
    """Enqueue blocks [first, end) of a block-outermost cache on the copy engines when each is one
    stretch in the pool (its pages consecutive, as the pool hands them out unless it is fragmented)
    and their runs (merged where they continue each other) are DMA_MIN_MEAN_RUN_BYTES or more on
    average: the event of their landing; else None, enqueuing nothing."""
    block_ids, page_ids = block_ids[first:end], page_ids[first:end]
    pool_blocks = layout.template.pool_stretches(pool_address, page_ids, layout.page_size)
    if pool_blocks is None:
        return None
    gpu_blocks = layout.template.gpu_stretches(layout.bases, block_ids)
    sizes = np.full(len(block_ids), layout.block_bytes, dtype=np.int64)
    dst, src, run_sizes = coalesce(gpu_blocks, pool_blocks, sizes)
    if layout.block_bytes * len(block_ids) < DMA_MIN_MEAN_RUN_BYTES * len(run_sizes):
        return None
    cuda_dma.copy(dst, src, run_sizes, lane.dma.cuda_stream)
    return _recorded(lane.dma)


def _strided_chunk(  # noqa: PLR0913
    layout: GpuLayout, block_ids: np.ndarray, pool_address: int, page_ids: np.ndarray, lane: CopyLane, first: int, end: int
) -> torch.cuda.Event | None:
    """Enqueue blocks [first, end) of a cache with several runs a block on the copy engines when they
    follow each other (`_following_blocks`); else None, enqueuing nothing."""
    following = _following_blocks(layout, block_ids[first:end], pool_address, page_ids[first:end])
    return None if following is None else following.enqueue(0, end - first, lane)


def _chunk_starts(n: int, block_bytes: int, min_blocks: int) -> list[int]:
    """Where a DMA load's chunks start: a first chunk of about HEAD_BYTES, which moves while the rest is
    planned, the bulk, then a chunk of about 1/TAIL_SHARE of the blocks and a last one of about
    1/TAIL_SHARE of that (each chunk is checksummed in HBM while the smaller ones after it move);
    every chunk at least `min_blocks` long (the fewest whose copies suit DMA), as far as n allows."""
    head = max(min_blocks, HEAD_BYTES // block_bytes)
    last = max(min_blocks, n // TAIL_SHARE**2)
    middle = max(min_blocks, n // TAIL_SHARE)
    starts = [0]
    for start in sorted({head, n - middle - last, n - last}):
        if start - starts[-1] >= min_blocks and n - start >= min_blocks:
            starts.append(start)
    return starts


def _lane_drained(lane: CopyLane, call: _Call | None = None) -> LaunchedCopy:
    """A copy of nothing that is done once everything enqueued on the lane so far has landed; it keeps
    `call`'s pinned arrays, which kernels launched before a failure still read and write, until then
    (freed, torch's pinned-memory cache would hand them to the next call at once)."""
    with torch.cuda.device(lane.device):
        lane.kernel.wait_event(_recorded(lane.dma))
        drained = LaunchedCopy.of_nothing(_recorded(lane.kernel))
        if call is not None:
            drained.call = call.memory
        return drained


def _recorded(stream: torch.cuda.Stream) -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record(stream)
    return event


def copy_blocks(*args, **kwargs) -> np.ndarray:
    """`launch_copy` and wait: the blocks' checksums once the copy is done. When it fails, the error
    goes up once what was enqueued has landed."""
    try:
        launched = launch_copy(*args, **kwargs)
    except LaunchFailed as failed:
        failed.enqueued.wait()
        raise
    return launched.wait()


def compile_kernel() -> None:
    """Compile the kernel's three forms (a second or two each, once per process) by running them over
    one block of one word in the current device's memory (other devices load the compiled kernel,
    which is quick). Every launch after that has the same argument types: nothing more to compile."""
    device = torch.device("cuda", torch.cuda.current_device())
    words = torch.zeros(2, dtype=torch.int64, device=device)
    template = SegmentTemplate.build([Run(0, 0, 8, 8)], 8)
    layout = GpuLayout.on(template, np.array([words.data_ptr()], dtype=np.int64), 8, device)
    call = _Call.of(layout, np.zeros(1, dtype=np.int64), np.ones((1, 1), dtype=np.int64))
    for mode in (TO_POOL, FROM_POOL, CHECK_IN_PLACE):
        call.launch(layout, words.data_ptr(), 0, 1, mode)
    torch.cuda.current_stream().synchronize()
