"""An engine's KV cache seen as whole blocks, and its copies to and from the pool.

Covers the layouts where every layer is its own tensor whose first dimension is the block id and each
block of a layer is one contiguous run (vLLM's CPU backend: `[num_blocks, kv_heads, block_size,
2 * head_size]`, K rows then V rows per head). A pool block is the concatenation of the block's bytes
in every layer, in layer order. Copies move whole blocks, one numpy gather or scatter per layer and
direction (numpy views of the KV tensors; torch's index_copy_ is several times slower on the CPU),
and never slice per token. When every layer's bytes fill whole pool pages, a layer is
copied straight between its KV tensor and its pages (loads in pieces of about 2 MiB, which is 1.5x
faster than whole layers on the CPU: the checksum reads the piece while it is still cached);
otherwise blocks pass through a contiguous staging buffer.
"""

from __future__ import annotations

import numpy as np
import torch

from kvtier import checksum
from kvtier.pool_view import PageView

CACHE_CHUNK_BYTES = 2 << 20  # loads copy this much at a time, so each piece is still in cache when it is checked


class LayerMajorKV:
    def __init__(self, layers: list[torch.Tensor]) -> None:
        if not layers:
            raise ValueError("no KV cache layers")
        if any(layer.device.type != "cpu" for layer in layers):
            raise ValueError("LayerMajorKV takes KV caches in host memory (GPU caches: kvtier.engine.gpu_kv.GpuKV)")
        num_blocks = layers[0].shape[0]
        self._views: list[np.ndarray] = []
        for layer in layers:
            if layer.shape[0] != num_blocks or not layer.is_contiguous():
                raise ValueError(f"unsupported KV layout: shape {tuple(layer.shape)}, strides {layer.stride()}")
            self._views.append(layer.view(torch.uint8).reshape(num_blocks, -1).numpy())
        self.num_blocks = num_blocks
        self.chunk_bytes = [v.shape[1] for v in self._views]
        self.block_bytes = sum(self.chunk_bytes)
        self._offsets = np.cumsum([0, *self.chunk_bytes[:-1]]).tolist()

    def snapshot(self, block_ids: list[int]) -> list[np.ndarray]:
        """A copy of the blocks, one [n, chunk_bytes] uint8 array per layer (so the engine may reuse them)."""
        index = np.asarray(block_ids, dtype=np.int64)
        return [view[index] for view in self._views]

    def write_pool(self, view: PageView, page_ids: np.ndarray, layers: list[np.ndarray]) -> np.ndarray:
        """Write snapshot rows into the pool blocks `page_ids` [n, pages_per_block]; their checksums."""
        page_size = view.page_size
        if not _page_aligned(self.chunk_bytes, page_size):
            blocks = np.concatenate(layers, axis=1)
            view.write_blocks(page_ids, blocks)
            return checksum.block_checksums(blocks)
        parts = []
        for rows, size, offset in zip(layers, self.chunk_bytes, self._offsets, strict=True):
            pages = _chunk_pages(page_ids, offset, size, page_size)
            view.pages[pages] = rows.reshape(*pages.shape, page_size)
            parts.append(checksum.chunk_sums(rows, offset))
        return checksum.combine(parts)

    def read_pool(self, view: PageView, page_ids: np.ndarray, block_ids: list[int]) -> np.ndarray:
        """Copy pool blocks `page_ids` into the engine blocks `block_ids`; the checksums of what was copied."""
        index = np.asarray(block_ids, dtype=np.int64)
        page_size = view.page_size
        if not _page_aligned(self.chunk_bytes, page_size):
            blocks = view.read_blocks(page_ids, self.block_bytes)
            for layer, target in enumerate(self._views):
                start = self._offsets[layer]
                target[index] = blocks[:, start : start + self.chunk_bytes[layer]]
            return checksum.block_checksums(blocks)
        sums = np.zeros(len(index), dtype=np.uint64)
        for layer, target in enumerate(self._views):
            pages = _chunk_pages(page_ids, self._offsets[layer], self.chunk_bytes[layer], page_size)
            step = max(1, CACHE_CHUNK_BYTES // self.chunk_bytes[layer])
            for start in range(0, len(index), step):  # cache-sized pieces: the scatter and the checksum read warm rows
                rows = np.take(view.pages, pages[start : start + step].ravel(), axis=0).reshape(-1, self.chunk_bytes[layer])
                target[index[start : start + step]] = rows
                with np.errstate(over="ignore"):
                    sums[start : start + step] += checksum.chunk_sums(rows, self._offsets[layer])
        return checksum.combine([sums])


def _page_aligned(chunk_bytes: list[int], page_size: int) -> bool:
    return all(size % page_size == 0 for size in chunk_bytes)


def _chunk_pages(page_ids: np.ndarray, offset: int, size: int, page_size: int) -> np.ndarray:
    first = offset // page_size
    return page_ids[:, first : first + size // page_size]
