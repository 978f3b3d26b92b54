"""gpu_copy between a GPU KV cache and a mapped pool, as the shm fallback and the daemon run it:
stores through the copy kernel; loads of long runs through the copy engines (then a checksum pass
on the GPU side), of short runs through the kernel; all byte-exact with kvtier.checksum's checksums."""

from __future__ import annotations

import os
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


@gpu
@pytest.mark.parametrize(
    ("layout", "pages", "dma"),
    [("BLHNC", "consecutive", True), ("BLHNC", "scattered", False), ("LBHNC", "consecutive", False)],
)
def test_copy_to_pool_and_back_byte_exact_with_checksums(pool, layout, pages, dma, monkeypatch):
    from kvtier import cuda_dma, gpu_copy  # noqa: PLC0415 (needs triton)
    from kvtier.copy_plan import SegmentTemplate  # noqa: PLC0415
    from kvtier.engine.gpu_kv import GpuKV  # noqa: PLC0415

    if dma and not cuda_dma.available():
        pytest.skip("this driver has no cuMemcpyBatchAsync (CUDA 12.8+)")
    g = Geometry(layers=4, num_blocks=64)  # 256 KiB blocks: 8 pages each
    buffer, views = allocate_kv_cache(g, layout)
    buffer.copy_(torch.randint(-128, 128, buffer.shape, dtype=torch.int8, device="cuda"))
    kv = GpuKV(list(views.values()), g.num_blocks)
    n, per_block = 16, g.block_bytes // PAGE
    order = np.arange(POOL_PAGES) if pages == "consecutive" else np.random.default_rng(3).permutation(POOL_PAGES)
    page_ids = order[: n * per_block].reshape(n, per_block).astype(np.uint32)
    sources, targets = list(range(n)), list(range(32, 32 + n))
    kv.record_ready()

    stored = kv.to_pool(pool, page_ids, sources)
    with ThreadPoolExecutor(1) as fresh:  # a thread with no CUDA call yet, as the daemon's copy threads start
        loaded = fresh.submit(kv.from_pool, pool, page_ids, targets).result()
    template = SegmentTemplate.build([r.run for r in kv.runs], PAGE)
    bases = np.array([s.data_ptr() for s in kv.storages], dtype=np.int64)
    assert (gpu_copy.dma_runs(template, bases, np.array(targets), pool.cuda_address(), page_ids, PAGE) is not None) == dma
    # fewer blocks: 5 of 256 KiB, still one run of 1.25 MiB for the copy engines (watched: the real
    # driver call, counted); two batches on one stream, each waited for alone; and none at all
    dma_calls = []
    monkeypatch.setattr(cuda_dma, "copy", lambda *args, real=cuda_dma.copy: dma_calls.append(real(*args)))
    stream = torch.cuda.Stream()

    def launch_load(blocks: np.ndarray, pages: np.ndarray):
        return gpu_copy.launch_copy(template, bases, blocks, pool.cuda_address(), pages, PAGE, False, buffer.device, stream)

    five, one = launch_load(np.arange(56, 61), page_ids[:5]), launch_load(np.arange(61, 62), page_ids[7:8])
    assert len(dma_calls) == (1 if dma else 0)  # one block of 256 KiB: the kernel
    with ThreadPoolExecutor(1) as other:
        five = other.submit(five.wait).result()
    one = one.wait()
    none = launch_load(np.arange(0), page_ids[:0]).wait()

    torch.cuda.synchronize()
    in_pool = pool.view.read_blocks(page_ids, g.block_bytes)
    expected = torch.cat([v.view(torch.uint8).flatten(1)[:n] for v in views.values()], dim=1).cpu().numpy()
    assert np.array_equal(in_pool, expected)
    for view in views.values():
        as_bytes = view.view(torch.uint8)  # (random bytes hold NaNs, which never equal themselves)
        assert torch.equal(as_bytes[32 : 32 + n], as_bytes[:n])
        assert torch.equal(as_bytes[56:61], as_bytes[:5]) and torch.equal(as_bytes[61], as_bytes[7])
    assert np.array_equal(stored, checksum.block_checksums(expected))
    assert np.array_equal(loaded, stored)
    assert np.array_equal(five, stored[:5]) and np.array_equal(one, stored[7:8]) and len(none) == 0


@gpu
def test_the_warm_up_compiles_the_kernel_every_copy_runs(pool):
    """compile_kernel leaves nothing to compile for copies of any size (the daemon launches them on its
    event loop, which a compilation would stall for seconds)."""
    from kvtier import gpu_copy  # noqa: PLC0415 (needs triton)

    gpu_copy.compile_kernel()
    compiled = _compiled_kernels(gpu_copy._copy_segments)
    buffer = torch.zeros(64, dtype=torch.int64, device="cuda")
    for n in (1, 2, 3, 8):  # rows of the address table start at every alignment an odd count gives
        addresses = buffer.data_ptr() + 8 * np.arange(n, dtype=np.int64)
        words, out = np.ones(n, dtype=np.int64), torch.empty(n, dtype=torch.int64, device="cuda")
        gpu_copy.run_segments(addresses, addresses + 8 * 32, words, words, out)
        gpu_copy.run_segments(addresses, None, words, words, out)
    torch.cuda.synchronize()
    assert _compiled_kernels(gpu_copy._copy_segments) == compiled


def _compiled_kernels(kernel) -> int:
    """How many forms of a Triton kernel this process compiled for the current device."""
    caches = getattr(kernel, "device_caches", None)
    if caches is None:
        pytest.skip("this Triton keeps its compiled kernels elsewhere")
    return len(caches[torch.cuda.current_device()][0])
