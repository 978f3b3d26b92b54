"""One batch of blocks between GPU memory and the pinned pool, copied and checksummed.

Stores, and loads of short runs, take one kernel launch: each Triton program copies one segment (see
copy_plan) as 64-bit words between any two addresses the GPU can reach (the engine's KV cache opened
through CUDA IPC, or the pool registered with cudaHostRegister, read and written over PCIe) and adds
up the checksum while the words pass through registers (about 0.92 of a bulk memcpy).
Loads of long runs (a block-outermost KV cache whose blocks sit in consecutive pool pages, as the
pool hands them out) go through the copy engines instead: segments that continue each other on both
sides merge into runs, cuda_dma moves them (about 0.98 of a bulk memcpy), and the kernel then adds up
the checksums from the engine's copy in HBM (some 2 TB/s: 0.05 ms for 170 MB). Stores stay on the
kernel: with four stores in flight on an H200, DMA from the GPU to the pool reached 39-49 GB/s where
the kernel reached 50-52.
Either way each block's checksum is kvtier.checksum's (each word times the splitmix64 weight of its
position in the block), so stores get their checksums and loads their verification.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from kvtier import checksum, cuda_dma
from kvtier.copy_plan import WORD, SegmentTemplate, coalesce

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


def copy_blocks(
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
) -> np.ndarray:
    """Copy whole blocks between a GPU KV cache (laid out as `template` over `allocation_bases`) and
    pool pages, on `stream` after the event `after` (if any); returns the blocks' checksums once done."""
    gpu, pool = template.addresses(allocation_bases, np.asarray(block_ids, dtype=np.int64), pool_address, page_ids, page_size)
    n = len(block_ids)
    words, first = np.tile(template.words, n), np.tile(template.first_word, n)
    src, dst = (gpu, pool) if to_pool else (pool, gpu)
    with torch.cuda.device(device):
        if after is not None:
            stream.wait_event(after)
        run_src, run_dst, run_sizes = coalesce(src, dst, words * WORD)
        if not to_pool and by_dma(run_sizes):
            cuda_dma.copy(run_dst, run_src, run_sizes, stream.cuda_stream)
            partial = run_segments(gpu, None, words, first, device, stream)  # what landed, read in HBM
        else:
            partial = run_segments(src, dst, words, first, device, stream)
        with torch.cuda.stream(stream):
            sums = torch.empty(len(partial), dtype=torch.int64, pin_memory=True)
            sums.copy_(partial, non_blocking=True)
        stream.synchronize()
    per_segment = sums.numpy().view(np.uint64).reshape(n, -1)
    with np.errstate(over="ignore"):
        return checksum.combine([per_segment.sum(axis=1, dtype=np.uint64)])


def by_dma(run_sizes: np.ndarray) -> bool:
    """Whether the copy engines load these runs faster than the kernel would."""
    return cuda_dma.available() and int(run_sizes.sum()) >= DMA_MIN_MEAN_RUN_BYTES * len(run_sizes)


def run_segments(
    src: np.ndarray,
    dst: np.ndarray | None,
    words: np.ndarray,
    first_words: np.ndarray,
    device: torch.device,
    stream: torch.cuda.Stream,
) -> torch.Tensor:
    """Launch the kernel on `stream` over segments at src[i] (addresses, int64): copies them to dst[i]
    unless dst is None, and returns the per-segment partial checksums (int64 on the device, ready
    when the stream reaches this point)."""
    copy = dst is not None
    with torch.cuda.stream(stream):
        table = torch.from_numpy(np.stack([src, dst if copy else src, words, first_words])).pin_memory()
        table = table.to(device, non_blocking=True)
        partial = torch.empty(len(src), dtype=torch.int64, device=device)
        _copy_segments[(len(src),)](table[0], table[1], table[2], table[3], partial, STEP=WORDS_PER_STEP, COPY=copy, num_warps=4)
    return partial
