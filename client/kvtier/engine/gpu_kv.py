"""An engine's GPU KV cache seen as runs of whole blocks: what the daemon needs for CUDA IPC, and the
engine-side copies of the shm fallback.

vLLM hands connectors one tensor per layer. Whatever the layout, block b of a layer is one or two
contiguous byte runs at a fixed stride:
- vLLM 0.33 views one int8 allocation as `[num_blocks, heads, block_size, 2 * head_size]` per layer;
  layer-major (LBHNC, the default) puts a layer's blocks next to each other, block-outermost (BLHNC)
  puts a block's layers next to each other, so the per-layer runs of a block merge into one run.
- vLLM 0.32 gives every layer its own `[2, num_blocks, ...]` tensor: a K run and a V run.
A pool block is the block's runs concatenated in order. Layers that alias another layer's memory
(shared KV) are skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvtier import checksum
from kvtier.engine.kv_blocks import write_rows
from kvtier.pool_view import PageView
from kvtier.v1 import kvtier_pb2 as pb


@dataclass(frozen=True)
class RunView:
    storage: int  # index into GpuKV.storages
    offset: int  # bytes from the storage's start for block 0
    block_stride: int
    size: int
    rows: torch.Tensor  # uint8 [num_blocks, size] view of the run


def block_runs(tensors: list[torch.Tensor], num_blocks: int) -> tuple[list[torch.UntypedStorage], list[RunView]]:
    """The storages behind `tensors` and every run of a block, in pool order. A block's part of a
    layer may be laid out in any order (HND, NHD, ...) as long as it fills one dense byte range."""
    storages: list[torch.UntypedStorage] = []
    bases: list[torch.Tensor] = []  # a uint8 tensor over each whole storage
    runs: list[RunView] = []
    seen: set[tuple[int, int]] = set()
    for tensor in tensors:
        split_kv = tensor.dim() >= 2 and tensor.shape[0] == 2 and tensor.shape[1] == num_blocks
        for part in [tensor[0], tensor[1]] if split_kv else [tensor]:
            if part.shape[0] != num_blocks:
                raise ValueError(f"unsupported KV layout: shape {tuple(tensor.shape)} has no block dimension of {num_blocks}")
            size = _dense_block_bytes(part)
            storage = part.untyped_storage()
            pointers = [s.data_ptr() for s in storages]
            if storage.data_ptr() not in pointers:
                storages.append(storage)
                bases.append(torch.empty(0, dtype=torch.uint8, device=part.device).set_(storage))
                pointers.append(storage.data_ptr())
            index = pointers.index(storage.data_ptr())
            offset = part.storage_offset() * part.element_size()
            if (index, offset) in seen:  # a layer sharing another layer's KV
                continue
            seen.add((index, offset))
            stride = part.stride(0) * part.element_size()
            last = runs[-1] if runs else None
            if last and last.storage == index and last.block_stride == stride and last.offset + last.size == offset:
                offset, size = last.offset, last.size + size  # the block's runs touch: one run
                runs.pop()
            rows = bases[index].as_strided((num_blocks, size), (stride, 1), offset)
            runs.append(RunView(index, offset, stride, size, rows))
    return storages, runs


def _dense_block_bytes(part: torch.Tensor) -> int:
    """Bytes of one block of `part` [num_blocks, ...], which must fill a dense range (any dim order)."""
    inner = [(part.stride(d), part.shape[d]) for d in range(1, part.dim()) if part.shape[d] > 1]
    expected = 1
    for stride, extent in sorted(inner):
        if stride != expected:
            raise ValueError(f"unsupported KV layout: a block of shape {tuple(part.shape)}, strides {part.stride()} has gaps")
        expected *= extent
    return expected * part.element_size()


class GpuKV:
    def __init__(self, tensors: list[torch.Tensor], num_blocks: int) -> None:
        if not tensors or any(t.device.type != "cuda" for t in tensors):
            raise ValueError("GpuKV needs KV tensors on a CUDA device")
        self.device = tensors[0].device
        self.num_blocks = num_blocks
        self.storages, self.runs = block_runs(tensors, num_blocks)
        self.chunk_bytes = [run.size for run in self.runs]
        self.block_bytes = sum(self.chunk_bytes)
        self._offsets = np.cumsum([0, *self.chunk_bytes[:-1]]).tolist()
        self.ready = torch.cuda.Event(interprocess=True)

    # ------------------------------------------------------------------ cuda_ipc transport

    def describe(self) -> pb.CudaKVCache:
        """What the daemon needs to open the cache and find every block (sent at Register)."""
        allocations = []
        for storage in self.storages:
            _, handle, size, offset, counter, counter_offset, event, event_sync = storage._share_cuda_()
            allocations.append(
                pb.CudaAllocation(
                    ipc_handle=handle,
                    size_bytes=size,
                    offset=offset,
                    ref_counter_handle=counter,
                    ref_counter_offset=counter_offset,
                    event_handle=event or b"",
                    event_sync_required=event_sync,
                )
            )
        return pb.CudaKVCache(
            device_uuid=str(torch.cuda.get_device_properties(self.device).uuid),
            allocations=allocations,
            runs=[
                pb.KVRun(allocation=r.storage, offset=r.offset, block_stride=r.block_stride, size_bytes=r.size) for r in self.runs
            ],
            num_blocks=self.num_blocks,
            ready_event=self.ready.ipc_handle(),
        )

    def record_ready(self) -> None:
        """Mark the engine's stream after the forward: the daemon's copies of these blocks wait for it."""
        self.ready.record(torch.cuda.current_stream(self.device))

    # ------------------------------------------------------------------ shm fallback (the engine copies)

    def snapshot(self, block_ids: list[int]) -> list[np.ndarray]:
        """A host copy of the blocks, one [n, run_bytes] uint8 array per run."""
        index = torch.as_tensor(block_ids, dtype=torch.int64, device=self.device)
        rows = torch.cat([run.rows.index_select(0, index) for run in self.runs], dim=1).cpu().numpy()
        return np.split(rows, np.cumsum(self.chunk_bytes[:-1]).tolist(), axis=1)

    def write_pool(self, view: PageView, page_ids: np.ndarray, layers: list[np.ndarray]) -> np.ndarray:
        return write_rows(view, page_ids, layers, self.chunk_bytes, self._offsets)

    def read_pool(self, view: PageView, page_ids: np.ndarray, block_ids: list[int]) -> np.ndarray:
        blocks = view.read_blocks(page_ids, self.block_bytes)
        index = torch.as_tensor(block_ids, dtype=torch.int64, device=self.device)
        on_device = torch.from_numpy(blocks).pin_memory().to(self.device, non_blocking=True)
        for run, start in zip(self.runs, self._offsets, strict=True):
            run.rows.index_copy_(0, index, on_device[:, start : start + run.size])
        torch.cuda.current_stream(self.device).synchronize()
        return checksum.block_checksums(blocks)
