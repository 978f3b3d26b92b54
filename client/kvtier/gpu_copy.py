"""One kernel launch per batch: copy segments between GPU memory and the pinned pool, and checksum them.

Each Triton program copies one segment (see copy_plan) as 64-bit words, from any address the GPU can
reach to any other: the engine's KV cache (opened through CUDA IPC) or the pool (host memory
registered with cudaHostRegister, which the GPU reads and writes over PCIe). While the words pass
through registers the program adds up the block checksum of kvtier.checksum (each word times the
splitmix64 weight of its position in the block), so stores get their checksums and loads their
verification without a second pass over the bytes.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from kvtier import checksum
from kvtier.copy_plan import SegmentTemplate

WORDS_PER_STEP = 1024  # 8 KiB per loop iteration of a program


@triton.jit
def _copy_segments(src_addresses, dst_addresses, word_counts, first_words, partial_sums, STEP: tl.constexpr):
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
    with torch.cuda.device(device):
        if after is not None:
            stream.wait_event(after)
        src, dst = (gpu, pool) if to_pool else (pool, gpu)
        partial = copy_segments(src, dst, words, first, device, stream)
        return block_checksums(partial, n, stream)


def copy_segments(
    src: np.ndarray, dst: np.ndarray, words: np.ndarray, first_words: np.ndarray, device: torch.device, stream: torch.cuda.Stream
) -> torch.Tensor:
    """Launch the copy of segments src[i] -> dst[i] (addresses, int64) on `stream`; returns the
    per-segment partial checksums (int64 on the device, ready when the stream reaches this point)."""
    with torch.cuda.stream(stream):
        table = torch.from_numpy(np.stack([src, dst, words, first_words])).pin_memory().to(device, non_blocking=True)
        partial = torch.empty(len(src), dtype=torch.int64, device=device)
        _copy_segments[(len(src),)](table[0], table[1], table[2], table[3], partial, STEP=WORDS_PER_STEP, num_warps=4)
    return partial


def block_checksums(partial: torch.Tensor, n_blocks: int, stream: torch.cuda.Stream) -> np.ndarray:
    """Per-block kvtier checksums from per-segment partials (block-major); waits for the copy."""
    stream.synchronize()
    sums = partial.cpu().numpy().view(np.uint64).reshape(n_blocks, -1)
    with np.errstate(over="ignore"):
        return checksum.combine([sums.sum(axis=1, dtype=np.uint64)])
