"""One batch of blocks between GPU memory and the pinned pool, copied and checksummed.

Stores, and loads of short runs, take one kernel launch: each Triton program copies one segment (see
copy_plan) as 64-bit words between any two addresses the GPU can reach (the engine's KV cache opened
through CUDA IPC, or the pool registered with cudaHostRegister, read and written over PCIe) and adds
up the checksum while the words pass through registers (about 0.92 of a bulk memcpy).
Loads of long runs (a block-outermost KV cache whose blocks sit in consecutive pool pages, as the
pool hands them out) go through the copy engines instead: whole blocks, consecutive ones merged into
runs, moved by cuda_dma (about 0.98 of a bulk memcpy) and enqueued before the kernel's tables are
even built; the kernel then adds up the checksums from the engine's copy in HBM (0.2-0.3 ms for 170
MB). Stores stay on the kernel: with four stores in flight on an H200, DMA from the GPU to the pool
reached 39-49 GB/s where the kernel reached 50-52.
Either way each block's checksum is kvtier.checksum's (each word times the splitmix64 weight of its
position in the block), so stores get their checksums and loads their verification.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from kvtier import checksum, cuda_dma
from kvtier.copy_plan import SegmentTemplate, coalesce

WORDS_PER_STEP = 1024  # 8 KiB per loop iteration of a program
DMA_MIN_MEAN_RUN_BYTES = 1 << 20  # below this, per-copy costs make DMA slower than the kernel


@triton.jit
def _copy_segments(src_addresses, dst_addresses, word_counts, first_words, partial_sums, STEP: tl.constexpr, COPY: tl.constexpr):
    segment = tl.program_id(0)
    src = tl.load(src_addresses + segment).to(tl.pointer_type(tl.uint64))
    dst = tl.load(dst_addresses + segment).to(tl.pointer_type(tl.uint64))
    count = tl.load(word_counts + segment)
    first = tl.load(first_words + segment).to(tl.uint64)
    lanes = tl.arange(0, STEP)
    total = tl.zeros([STEP], dtype=tl.uint64)
    for start in range(0, count, STEP):
        index = start + lanes
        inside = index < count
        words = tl.load(src + index, mask=inside, other=0)
        if COPY:
            tl.store(dst + index, words, mask=inside)
        z = (first + index.to(tl.uint64) + 1) * 0x9E3779B97F4A7C15
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB
        z = (z ^ (z >> 31)) | 1
        total += words * z
    tl.store(partial_sums + segment, tl.sum(total, axis=0))


@dataclass
class LaunchedCopy:
    """A batch enqueued on its stream; `wait` returns the blocks' checksums once it is done."""

    done: torch.cuda.Event | None  # None: no block, nothing enqueued
    sums: torch.Tensor  # pinned int64 per segment, written by the stream before `done`
    blocks: int

    def wait(self) -> np.ndarray:
        if self.done is None:
            return np.empty(0, dtype=np.uint64)
        self.done.synchronize()  # this copy only: later batches on the same stream do not delay it
        per_segment = self.sums.numpy().view(np.uint64).reshape(self.blocks, -1)
        with np.errstate(over="ignore"):
            return checksum.combine([per_segment.sum(axis=1, dtype=np.uint64)])


def launch_copy(
    template: SegmentTemplate,
    allocation_bases: np.ndarray,
    block_ids: np.ndarray,
    pool_address: int,
    page_ids: np.ndarray,
    page_size: int,
    to_pool: bool,
    device: torch.device,
    stream: torch.cuda.Stream,
    after=None,
) -> LaunchedCopy:
    """Enqueue the copy of whole blocks between a GPU KV cache (laid out as `template` over
    `allocation_bases`) and pool pages on `stream`, after the event `after` (if any; stores); returns
    at once. A load through the copy engines starts before anything else is prepared. Should
    anything fail after that, the stream is drained before the error goes up (the caller may then
    free the pages and close the mappings)."""
    block_ids = np.asarray(block_ids, dtype=np.int64)
    n = len(block_ids)
    if n == 0:
        return LaunchedCopy(None, torch.empty(0, dtype=torch.int64), 0)
    if after is not None:
        stream.wait_event(after)
    runs = None if to_pool else dma_runs(template, allocation_bases, block_ids, pool_address, page_ids, page_size)
    if runs is not None:
        pool_runs, gpu_runs, run_sizes = runs
        cuda_dma.copy(gpu_runs, pool_runs, run_sizes, stream.cuda_stream)
    try:
        with torch.cuda.device(device), torch.cuda.stream(stream):
            gpu, pool = template.addresses(allocation_bases, block_ids, pool_address, page_ids, page_size)
            words, first = np.tile(template.words, n), np.tile(template.first_word, n)
            partial = torch.empty(len(gpu), dtype=torch.int64, device=device)
            if runs is not None:
                run_segments(gpu, None, words, first, partial)  # what landed, read in HBM
            else:
                src, dst = (gpu, pool) if to_pool else (pool, gpu)
                run_segments(src, dst, words, first, partial)
            sums = torch.empty(len(partial), dtype=torch.int64, pin_memory=True)
            sums.copy_(partial, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
    except BaseException:
        stream.synchronize()  # what was enqueued lands before anything it touches is freed or unmapped
        raise
    return LaunchedCopy(done, sums, n)


def dma_runs(
    template: SegmentTemplate, allocation_bases: np.ndarray, block_ids: np.ndarray, pool_address: int, page_ids, page_size: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(pool addresses, GPU addresses, sizes) of the runs the copy engines load, when they load these
    blocks faster than the kernel would: every block one stretch on both sides, consecutive ones
    merged, in runs of DMA_MIN_MEAN_RUN_BYTES or more on average; None otherwise."""
    if not cuda_dma.available():
        return None
    stretches = template.block_stretches(allocation_bases, block_ids, pool_address, page_ids, page_size)
    if stretches is None:
        return None
    gpu_blocks, pool_blocks = stretches
    runs = coalesce(pool_blocks, gpu_blocks, np.full(len(block_ids), template.block_bytes, dtype=np.int64))
    return runs if template.block_bytes * len(block_ids) >= DMA_MIN_MEAN_RUN_BYTES * len(runs[2]) else None


def copy_blocks(*args, **kwargs) -> np.ndarray:
    """`launch_copy` and wait: the blocks' checksums once the copy is done."""
    return launch_copy(*args, **kwargs).wait()


def compile_kernel() -> None:
    """Compile both forms of the copy kernel (a second or two each, once per process) by running them
    over one word of the current device's memory (other devices load the compiled kernel, which is
    quick)."""
    word = torch.zeros(1, dtype=torch.int64, device="cuda")
    address = np.array([word.data_ptr()], dtype=np.int64)
    one = np.ones(1, dtype=np.int64)
    for dst in (address, None):
        run_segments(address, dst, one, one, torch.empty(1, dtype=torch.int64, device="cuda"))
    torch.cuda.current_stream().synchronize()


def run_segments(src: np.ndarray, dst: np.ndarray | None, words: np.ndarray, first_words: np.ndarray, out: torch.Tensor) -> None:
    """Launch the kernel on the current stream over segments at src[i] (addresses, int64): copies them
    to dst[i] unless dst is None, and writes the per-segment partial checksums into `out` (int64 on
    the device, ready when the stream reaches this point)."""
    copy = dst is not None
    table = np.zeros((4, len(src) + len(src) % 2), dtype=np.int64)  # an even row length: every row 16-byte
    table[:, : len(src)] = src, dst if copy else src, words, first_words  # aligned, one form of the kernel
    table = torch.from_numpy(table).pin_memory().to(out.device, non_blocking=True)
    _copy_segments[(len(src),)](table[0], table[1], table[2], table[3], out, STEP=WORDS_PER_STEP, COPY=copy, num_warps=4)
