"""An engine's GPU KV cache seen as runs of whole blocks: what the daemon needs for CUDA IPC, and the
engine-side copies of the shm fallback (the daemon's copies, kvtier.gpu_copy, run by the engine on a
side stream between its KV cache and its mapping of the pool, which it registers with
cudaHostRegister).

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

from kvtier.copy_plan import Run, SegmentTemplate
from kvtier.pool_view import PoolMapping
from kvtier.v1 import kvtier_pb2 as pb

READY_EVENTS = 64  # the ring of ready events: twice the GPU stores an engine keeps waiting (worker.MAX_PENDING_GPU_STORES)


@dataclass(frozen=True)
class RunView:
    run: Run  # its allocation is an index into GpuKV.storages, its offset counts from the storage's start
    rows: torch.Tensor  # uint8 [num_blocks, run.size] view of the run


def block_runs(tensors: list[torch.Tensor], num_blocks: int) -> tuple[list[torch.UntypedStorage], list[RunView]]:
    """The storages behind `tensors` and every run of a block, in pool order. A block's part of a
    layer may be laid out in any order (HND, NHD, ...) as long as it fills one dense byte range."""
    storages: list[torch.UntypedStorage] = []
    bases: list[torch.Tensor] = []  # a uint8 tensor over each whole storage
    index_of: dict[int, int] = {}  # storage address -> its index
    runs: list[RunView] = []
    seen: set[tuple[int, int]] = set()
    for tensor in tensors:
        split_kv = tensor.dim() >= 2 and tensor.shape[0] == 2 and tensor.shape[1] == num_blocks
        for part in [tensor[0], tensor[1]] if split_kv else [tensor]:
            if part.shape[0] != num_blocks:
                raise ValueError(f"unsupported KV layout: shape {tuple(tensor.shape)} has no block dimension of {num_blocks}")
            size = _dense_block_bytes(part)
            storage = part.untyped_storage()
            if storage.data_ptr() not in index_of:
                index_of[storage.data_ptr()] = len(storages)
                storages.append(storage)
                bases.append(torch.empty(0, dtype=torch.uint8, device=part.device).set_(storage))
            index = index_of[storage.data_ptr()]
            offset = part.storage_offset() * part.element_size()
            if (index, offset) in seen:  # a layer sharing another layer's KV
                continue
            seen.add((index, offset))
            stride = part.stride(0) * part.element_size()
            last = runs[-1].run if runs else None
            if last and last.allocation == index and last.block_stride == stride and last.offset + last.size == offset:
                offset, size = last.offset, last.size + size  # the block's runs touch: one run
                runs.pop()
            rows = bases[index].as_strided((num_blocks, size), (stride, 1), offset)
            runs.append(RunView(Run(index, offset, stride, size), rows))
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
        self.block_bytes = sum(r.run.size for r in self.runs)
        self.ready_events = [torch.cuda.Event(interprocess=True) for _ in range(READY_EVENTS)]
        self._next_ready = 0  # the ring's slot record_ready records next
        self._bases = np.array([storage.data_ptr() for storage in self.storages], dtype=np.int64)
        self._lane = None  # gpu_copy.CopyLane of the shm fallback, made on its first copy
        self._runs = [r.run for r in self.runs]
        self._layout = None  # gpu_copy.GpuLayout for the pool's page size, made on the first copy

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
                pb.KVRun(allocation=r.allocation, offset=r.offset, block_stride=r.block_stride, size_bytes=r.size)
                for r in self._runs
            ],
            num_blocks=self.num_blocks,
            ready_events=[event.ipc_handle() for event in self.ready_events],
        )

    def record_ready(self) -> int:
        """Mark the engine's stream after the forward with the ring's next event; its index, which the
        store of the forward's blocks names (the copy waits for it). Each event is recorded again only
        READY_EVENTS records later, so a store is not held up by later steps' forwards."""
        index = self._next_ready
        self.ready_events[index].record(torch.cuda.current_stream(self.device))
        self._next_ready = (index + 1) % READY_EVENTS
        return index

    # ------------------------------------------------------------------ shm fallback (the engine copies)

    def to_pool(self, pool: PoolMapping, page_ids: np.ndarray, block_ids: list[int], ready: int) -> np.ndarray:
        """Copy engine blocks into pool pages after the ring's ready event `ready` (a side stream: the
        compute stream never waits); their checksums once done. The daemon's kernel, run by the engine."""
        return self._copy(pool, page_ids, block_ids, after=self.ready_events[ready])

    def from_pool(self, pool: PoolMapping, page_ids: np.ndarray, block_ids: list[int]) -> np.ndarray:
        """Copy pool pages into engine blocks; the checksums of what was copied, once it is in place."""
        return self._copy(pool, page_ids, block_ids, after=None)

    def _copy(self, pool: PoolMapping, page_ids: np.ndarray, block_ids: list[int], after) -> np.ndarray:
        """Into the pool after the event `after`; out of it when `after` is None."""
        from kvtier.gpu_copy import CopyLane, GpuLayout, copy_blocks  # noqa: PLC0415 (triton)

        if self._lane is None:
            self._lane = CopyLane.on(self.device)
        page_size = pool.view.page_size
        if self._layout is None or self._layout.page_size != page_size:
            self._layout = GpuLayout.on(SegmentTemplate.build(self._runs, page_size), self._bases, page_size, self.device)
        return copy_blocks(
            self._layout,
            np.asarray(block_ids, dtype=np.int64),
            pool.cuda_address(),
            page_ids,
            after is not None,
            self._lane,
            after=after,
        )
