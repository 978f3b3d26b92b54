"""gpu_copy between a GPU KV cache and a mapped pool, as the shm fallback and the daemon run it:
stores through the copy kernel; loads from consecutive pool pages through the copy engines in chunks
(blocks that follow each other: one copy a chunk of a block-outermost cache, 2-D copies of a run of
them in the other layouts; else runs of whole blocks of a block-outermost cache; then a checksum
pass on the GPU side), other loads through the kernel; all byte-exact
with kvtier.checksum's checksums, and never a kernel form the warm-up did not compile."""

from __future__ import annotations

import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from fake_engine import Geometry, allocate_kv_cache, gpu  # noqa: E402 (needs torch)

from kvtier import checksum  # noqa: E402
from kvtier.pool_view import PoolMapping  # noqa: E402

PAGE = 32 << 10
POOL_PAGES = 512


@pytest.fixture
def pool():
    path = Path("/dev/shm") / f"kvtier-test-gpu-copy-{os.getpid()}"
    path.write_bytes(b"")
    os.truncate(path, POOL_PAGES * PAGE)
    mapping = PoolMapping(path, POOL_PAGES * PAGE, PAGE)
    yield mapping
    mapping.close()
    path.unlink()


def kv_cache(layout: str) -> tuple[dict[str, torch.Tensor], int]:
    """Random per-layer KV tensors and their blocks' bytes: vLLM 0.33's one buffer with strided views
    (4 layers, 256 KiB blocks: 8 segments in 8 pages), or vLLM 0.32's own [2, blocks, ...] tensor per
    layer ("split": 4 allocations, head size 40, 80 KiB blocks: 10 segments, cut at every K and V
    run and page boundary, in 3 pages)."""
    if layout == "split":
        views = {f"layer{i}": torch.empty(2, 64, 16, 8, 40, dtype=torch.bfloat16, device="cuda") for i in range(4)}
        for view in views.values():
            view.view(torch.int16).random_()
        return views, 4 * 2 * 16 * 8 * 40 * 2
    g = Geometry(layers=4, num_blocks=64)
    buffer, views = allocate_kv_cache(g, layout)
    buffer.copy_(torch.randint(-128, 128, buffer.shape, dtype=torch.int8, device="cuda"))
    return views, g.block_bytes


def block_bytes_of(view: torch.Tensor) -> torch.Tensor:
    """[blocks, bytes]: each block's bytes in one layer's tensor, in pool order (K then V)."""
    as_bytes = view.view(torch.uint8)  # (random bytes hold NaNs, which never equal themselves)
    return as_bytes.transpose(0, 1).flatten(1) if view.dim() == 5 else as_bytes.flatten(1)


@gpu
@pytest.mark.parametrize(
    ("layout", "pages", "dma_chunks"),
    [
        ("BLHNC", "consecutive", {"copy_linear": 4 + 4 + 1, "copy": 2}),
        ("BLHNC", "scattered", {}),
        ("LBHNC", "consecutive", {"copy_2d": 4 + 1 + 0 + 1}),
        ("split", "consecutive", {"copy_2d": 2 + 0 + 0 + 0}),
        ("split", "scattered", {}),
    ],
)
def test_copy_to_pool_and_back_byte_exact_with_checksums(pool, layout, pages, dma_chunks, monkeypatch):
    from kvtier import cuda_dma, gpu_copy  # noqa: PLC0415 (needs triton)
    from kvtier.copy_plan import SegmentTemplate  # noqa: PLC0415
    from kvtier.engine.gpu_kv import GpuKV  # noqa: PLC0415

    if dma_chunks and not cuda_dma.available():
        pytest.skip("this driver has no cuMemcpyBatchAsync (CUDA 12.8+)")
    views, block_bytes = kv_cache(layout)
    kv = GpuKV(list(views.values()), 64)
    n, per_block = 16, -(-block_bytes // PAGE)
    order = np.arange(POOL_PAGES) if pages == "consecutive" else np.random.default_rng(3).permutation(POOL_PAGES)
    page_ids = order[: n * per_block].reshape(n, per_block).astype(np.uint32)
    ready = kv.record_ready()
    gpu_copy.compile_kernel()
    compiled = _compiled_kernels(gpu_copy._copy_blocks)
    monkeypatch.setattr(gpu_copy, "MAX_GRID_BLOCKS", 3)  # every kernel copy in launches of 3 blocks or fewer

    stored = kv.to_pool(pool, page_ids, list(range(n)), ready)  # the engine's own lane (shm fallback)
    # eight more blocks where blocks 5 and 6 have their pages in reverse order (a fragmented pool)
    mixed_pages = order[n * per_block : (n + 8) * per_block].reshape(8, per_block).astype(np.uint32)
    mixed_pages[5:7] = mixed_pages[5:7, ::-1]
    mixed_stored = kv.to_pool(pool, mixed_pages, list(range(8)), ready)
    with ThreadPoolExecutor(1) as fresh:  # a thread with no CUDA call yet, as the engine's link thread starts
        loaded = fresh.submit(kv.from_pool, pool, page_ids, list(range(16, 16 + n))).result()
    bases = np.array([s.data_ptr() for s in kv.storages], dtype=np.int64)
    device = next(iter(views.values())).device
    gpu_layout = gpu_copy.GpuLayout.on(SegmentTemplate.build([r.run for r in kv.runs], PAGE), bases, PAGE, device)
    # a daemon's lane, taking copies of a block's size or more through the copy engines (watched: the
    # real driver calls, counted per chunk and kind). A block-outermost cache (one run of 256 KiB a
    # block): 16 blocks and 5 blocks in four chunks each (2 + 12 + 1 + 1, 2 + 1 + 1 + 1), one block in
    # one, each chunk one cuMemcpyAsync (the blocks follow each other); the eight blocks in four
    # chunks, batches of runs, of which the two holding blocks 5 and 6 go through the kernel (2 + 4 +
    # 1 + 1). Layer-major (4 runs of 64 KiB, one 2-D copy each a chunk): chunks of 4 blocks or more (16
    # blocks in 4, 5 in 1, one block through the kernel, the eight in 4 + 4 of which the chunk
    # holding blocks 5 and 6 goes through the kernel).
    # vLLM 0.32's (8 runs of 10 KiB, a block every 3 pages of 32 KiB in the pool): chunks of 8
    # blocks or more (16 blocks in 2). Two batches on one lane, each waited for alone; and one with
    # no block.
    monkeypatch.setattr(gpu_copy, "DMA_MIN_MEAN_RUN_BYTES", block_bytes)
    monkeypatch.setattr(gpu_copy, "DMA_MIN_STRIDED_BYTES", block_bytes)
    monkeypatch.setattr(gpu_copy, "HEAD_BYTES", 2 * block_bytes)
    dma_calls = Counter()
    for name in ("copy", "copy_2d", "copy_linear"):
        real = getattr(cuda_dma, name)
        monkeypatch.setattr(cuda_dma, name, lambda *args, name=name, real=real: dma_calls.update([name]) or real(*args))
    lane = gpu_copy.CopyLane.on(device)

    def launch_load(blocks: np.ndarray, pages: np.ndarray):
        return gpu_copy.launch_copy(gpu_layout, blocks, pool.cuda_address(), pages, False, lane)

    sixteen = launch_load(np.arange(32, 48), page_ids)
    five, one = launch_load(np.arange(56, 61), page_ids[:5]), launch_load(np.arange(61, 62), page_ids[7:8])
    mixed = launch_load(np.arange(48, 56), mixed_pages).wait()
    assert dma_calls == Counter(dma_chunks)
    with ThreadPoolExecutor(1) as other:
        five = other.submit(five.wait).result()
    one, sixteen = one.wait(), sixteen.wait()
    none = launch_load(np.arange(0), page_ids[:0]).wait()

    torch.cuda.synchronize()
    assert gpu_layout.segment_count == (10 if layout == "split" else per_block)
    blocks = [block_bytes_of(view) for view in views.values()]
    expected = torch.cat([b[:n] for b in blocks], dim=1).cpu().numpy()
    assert np.array_equal(pool.view.read_blocks(page_ids, block_bytes), expected)
    for b in blocks:
        assert torch.equal(b[16:32], b[:n]) and torch.equal(b[32:48], b[:n]) and torch.equal(b[48:56], b[:8])
        assert torch.equal(b[56:61], b[:5]) and torch.equal(b[61], b[7])
    assert np.array_equal(stored, checksum.block_checksums(expected))
    assert np.array_equal(loaded, stored) and np.array_equal(sixteen, stored)
    assert np.array_equal(five, stored[:5]) and np.array_equal(one, stored[7:8]) and len(none) == 0
    assert np.array_equal(mixed_stored, stored[:8]) and np.array_equal(mixed, stored[:8])
    assert _compiled_kernels(gpu_copy._copy_blocks) == compiled


@gpu
def test_a_launch_failing_midway_raises_at_once_with_what_to_wait_for(pool, monkeypatch):
    """Enqueueing fails after the copy engines took a BLHNC load's chunks (here: no pinned memory for
    the call's arrays). launch_copy raises LaunchFailed at once instead of draining the lane (busy for
    about 0.1 s first), and its `enqueued` is done once those chunks have landed, in place.
    copy_blocks, the engine's, waits for them before the error goes up."""
    from kvtier import cuda_dma, gpu_copy  # noqa: PLC0415 (needs triton)
    from kvtier.copy_plan import LaunchFailed, SegmentTemplate  # noqa: PLC0415
    from kvtier.engine.gpu_kv import GpuKV  # noqa: PLC0415

    if not cuda_dma.available():
        pytest.skip("this driver has no cuMemcpyBatchAsync (CUDA 12.8+)")
    views, block_bytes = kv_cache("BLHNC")
    kv = GpuKV(list(views.values()), 64)
    page_ids = np.arange(16 * (block_bytes // PAGE)).reshape(16, -1).astype(np.uint32)
    kv.to_pool(pool, page_ids, list(range(16)), kv.record_ready())
    bases = np.array([s.data_ptr() for s in kv.storages], dtype=np.int64)
    device = next(iter(views.values())).device
    layout = gpu_copy.GpuLayout.on(SegmentTemplate.build([r.run for r in kv.runs], PAGE), bases, PAGE, device)
    monkeypatch.setattr(gpu_copy, "DMA_MIN_MEAN_RUN_BYTES", block_bytes)

    def no_pinned_memory(cls, *args):
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(gpu_copy._Call, "of", classmethod(no_pinned_memory))
    lane = gpu_copy.CopyLane.on(device)
    with torch.cuda.stream(lane.dma):
        torch.cuda._sleep(2_000_000_000)  # the copy engines' stream busy for about a second before the load
    with pytest.raises(LaunchFailed) as failed:
        gpu_copy.launch_copy(layout, np.arange(32, 48), pool.cuda_address(), page_ids, False, lane)
    assert isinstance(failed.value.__cause__, RuntimeError)
    assert not failed.value.enqueued.finished()  # raised without waiting for the busy lane
    failed.value.enqueued.wait()
    for view in views.values():
        rows = block_bytes_of(view)
        assert torch.equal(rows[32:48], rows[:16])
    with torch.cuda.stream(lane.dma):
        torch.cuda._sleep(200_000_000)
    with pytest.raises(LaunchFailed) as again:
        gpu_copy.copy_blocks(layout, np.arange(48, 64), pool.cuda_address(), page_ids, False, lane)
    assert again.value.enqueued.finished()


def _compiled_kernels(kernel) -> int:
    """How many forms of a Triton kernel this process compiled for the current device."""
    caches = getattr(kernel, "device_caches", None)
    if caches is None:
        pytest.skip("this Triton keeps its compiled kernels elsewhere")
    return len(caches[torch.cuda.current_device()][0])
