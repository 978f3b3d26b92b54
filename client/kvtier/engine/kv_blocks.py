"""An engine's KV cache seen as whole blocks.

Covers the layouts where every layer is its own tensor whose first dimension is the block id and each
block of a layer is one contiguous run (vLLM's CPU backend: `[num_blocks, kv_heads, block_size,
2 * head_size]`, K rows then V rows per head). A pool block is the concatenation of the block's bytes
in every layer, in layer order; copies move whole blocks with one index_select / index_copy_ per layer
and never slice per token.
"""

from __future__ import annotations

import numpy as np
import torch


class LayerMajorKV:
    def __init__(self, layers: list[torch.Tensor]) -> None:
        if not layers:
            raise ValueError("no KV cache layers")
        if any(layer.device.type != "cpu" for layer in layers):
            raise ValueError("KV caches on an accelerator need the cuda_ipc transport, which this build does not have yet")
        num_blocks = layers[0].shape[0]
        self._views: list[torch.Tensor] = []
        for layer in layers:
            if layer.shape[0] != num_blocks or not layer.is_contiguous():
                raise ValueError(f"unsupported KV layout: shape {tuple(layer.shape)}, strides {layer.stride()}")
            self._views.append(layer.view(torch.uint8).reshape(num_blocks, -1))
        self.num_blocks = num_blocks
        self.chunk_bytes = [v.shape[1] for v in self._views]
        self.block_bytes = sum(self.chunk_bytes)

    def gather(self, block_ids: list[int]) -> np.ndarray:
        """A copy of the blocks' bytes, [n, block_bytes] uint8."""
        index = torch.tensor(block_ids, dtype=torch.long)
        return torch.cat([v.index_select(0, index) for v in self._views], dim=1).numpy()

    def scatter(self, block_ids: list[int], data: np.ndarray) -> None:
        """Write blocks' bytes [n, block_bytes] into the cache."""
        index = torch.tensor(block_ids, dtype=torch.long)
        source = torch.from_numpy(np.ascontiguousarray(data))
        offset = 0
        for view, size in zip(self._views, self.chunk_bytes, strict=True):
            view.index_copy_(0, index, source[:, offset : offset + size])
            offset += size
