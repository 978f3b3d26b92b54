"""The GPU copy plan, checked on the CPU: every byte of every block lands where the pool layout says,
and per-segment checksum parts add up to the block checksum the shm transport computes."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvtier import checksum  # noqa: E402
from kvtier.copy_plan import WORD, Run, SegmentTemplate, coalesce, follow_each_other  # noqa: E402
from kvtier.engine.gpu_kv import block_runs  # noqa: E402

PAGE = 4096
GPU_BASE, POOL_BASE = 1 << 40, 1 << 50  # symbolic addresses: the test maps them back to arrays


def addresses(template: SegmentTemplate, bases: np.ndarray, block_ids, pool_base: int, page_ids) -> tuple[np.ndarray, np.ndarray]:
    """Where the copy kernel finds segment k of block b, [n_blocks * segments] each, block-major: GPU
    base[allocation] + gpu_offset + b * block_stride, pool pages[b][page] * page_size + page_offset."""
    gpu = (
        bases[template.allocation] + template.gpu_offset + np.asarray(block_ids, dtype=np.int64)[:, None] * template.block_stride
    )
    pool = pool_base + np.asarray(page_ids, dtype=np.int64)[:, template.page] * PAGE + template.page_offset
    return gpu.ravel(), pool.ravel()


def run_segments(template: SegmentTemplate, memory: np.ndarray, pool: np.ndarray, block_ids, page_ids) -> np.ndarray:
    """What the copy kernel does, in numpy: copy every segment GPU -> pool; per-block checksums."""
    gpu, host = addresses(template, np.array([GPU_BASE]), block_ids, POOL_BASE, page_ids)
    n_seg = len(template.words)
    sums = np.zeros(len(block_ids), dtype=np.uint64)
    for i, (src, dst) in enumerate(zip(gpu - GPU_BASE, host - POOL_BASE, strict=True)):
        size = int(template.words[i % n_seg]) * WORD
        pool[dst : dst + size] = memory[src : src + size]
        part = checksum.chunk_sums(memory[src : src + size][None, :], int(template.first_word[i % n_seg]) * WORD)
        with np.errstate(over="ignore"):
            sums[i // n_seg] += part[0]
    return checksum.combine([sums])


def vllm_033_cache(layout: str, num_blocks=12, layers=3, heads=2, block_size=16, head_size=40):
    """One int8 buffer and per-layer [B, H, N, 2*head_size] fp16 views, as vLLM 0.33 allocates it."""
    page = heads * block_size * 2 * head_size * 2
    buffer = torch.randint(-128, 127, (num_blocks * layers * page,), dtype=torch.int8)
    views = []
    for layer in range(layers):
        if layout == "LBHNC":
            offset, block_stride = layer * num_blocks * page, page
        else:  # BLHNC
            offset, block_stride = layer * page, layers * page
        elems = page // 2
        view = torch.as_strided(
            buffer.view(torch.float16),
            (num_blocks, heads, block_size, 2 * head_size),
            (block_stride // 2, elems // heads, 2 * head_size, 1),
            offset // 2,
        )
        views.append(view)
    return buffer, views, page


@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC"])
def test_plan_moves_every_block_byte_exact(layout):
    buffer, views, page = vllm_033_cache(layout)
    storages, runs = block_runs(views, 12)
    assert len(storages) == 1
    assert len(runs) == (3 if layout == "LBHNC" else 1)  # a block-outermost block is one run
    template = SegmentTemplate.build([r.run for r in runs], PAGE)
    block_bytes = 3 * page
    assert template.block_bytes == block_bytes
    pages_per_block = -(-block_bytes // PAGE)
    page_ids = np.random.default_rng(1).permutation(64)[: 4 * pages_per_block].reshape(4, pages_per_block)
    memory = buffer.view(torch.uint8).numpy()
    pool = np.zeros(64 * PAGE, dtype=np.uint8)
    blocks = [7, 0, 11, 3]

    sums = run_segments(template, memory, pool, blocks, page_ids)

    stored = np.concatenate([p[None] for p in pool.reshape(64, PAGE)[page_ids].reshape(4, -1)])[:, :block_bytes]
    expected = np.concatenate([v.view(torch.uint8).flatten(1)[blocks].numpy() for v in views], axis=1)
    assert np.array_equal(stored, expected)
    assert np.array_equal(sums, checksum.block_checksums(expected))


def test_runs_of_vllm_032_split_kv_tensors():
    """vLLM 0.32 gives each layer its own [2, num_blocks, ...] tensor: a K run and a V run per layer."""
    layers = [torch.randn(2, 10, 16, 2, 8) for _ in range(2)]
    storages, runs = block_runs(layers, 10)
    assert len(storages) == 2
    assert [(r.run.allocation, r.run.size) for r in runs] == [(0, 1024), (0, 1024), (1, 1024), (1, 1024)]
    assert runs[1].run.offset == 10 * 1024  # V follows all K blocks
    assert torch.equal(runs[1].rows[4], layers[0][1, 4].flatten().view(torch.uint8))


def test_shared_layers_and_gaps():
    base = torch.randn(8, 2, 16, 8)
    _, runs = block_runs([base, base], 8)  # a layer sharing another's KV counts once
    assert len(runs) == 1
    padded = torch.randn(8, 2, 16, 9)[..., :8]  # rows with a gap: not one dense run
    with pytest.raises(ValueError, match="gaps"):
        block_runs([padded], 8)


def test_template_rejects_unaligned_runs():
    with pytest.raises(ValueError, match="aligned"):
        SegmentTemplate.build([Run(0, 4, 1024, 1024)], PAGE)


@pytest.mark.parametrize(("head_size", "runs"), [(32, 2), (40, 4)])
def test_stretches_merged_move_the_same_bytes(head_size, runs):
    """The copy engines' runs: a block-outermost cache in consecutive pool pages merges blocks 3, 4
    and 5 when a block fills its pages exactly (head size 32: 3 pages), and not when its last page
    has an unused tail (head size 40); either way the runs move exactly the segments' bytes."""
    buffer, views, page = vllm_033_cache("BLHNC", head_size=head_size)
    _, block_run = block_runs(views, 12)
    template = SegmentTemplate.build([r.run for r in block_run], PAGE)
    pages_per_block = -(-template.block_bytes // PAGE)
    page_ids = np.arange(4 * pages_per_block).reshape(4, pages_per_block)
    blocks = np.array([3, 4, 5, 9])
    gpu, host = addresses(template, np.array([GPU_BASE]), blocks, POOL_BASE, page_ids)
    sizes = np.tile(template.words, len(blocks)) * WORD

    gpu_blocks = template.gpu_stretches(np.array([GPU_BASE]), blocks)
    pool_blocks = template.pool_stretches(POOL_BASE, page_ids, PAGE)
    src, dst, run_sizes = coalesce(gpu_blocks, pool_blocks, np.full(len(blocks), template.block_bytes))

    assert len(src) == runs
    assert run_sizes.sum() == sizes.sum()
    memory = buffer.view(torch.uint8).numpy()
    by_segment, by_run = np.zeros(64 * PAGE, dtype=np.uint8), np.zeros(64 * PAGE, dtype=np.uint8)
    for pool, moves in ((by_segment, zip(gpu, host, sizes, strict=True)), (by_run, zip(src, dst, run_sizes, strict=True))):
        for s, d, n in moves:
            pool[d - POOL_BASE : d - POOL_BASE + n] = memory[s - GPU_BASE : s - GPU_BASE + n]
    assert by_run.any() and np.array_equal(by_run, by_segment)


def test_stretches_gpu_side_for_block_outermost_caches_pool_side_for_consecutive_pages():
    _, blhnc, _ = vllm_033_cache("BLHNC")
    _, lbhnc, _ = vllm_033_cache("LBHNC")
    block_outermost = SegmentTemplate.build([r.run for r in block_runs(blhnc, 12)[1]], PAGE)
    layer_major = SegmentTemplate.build([r.run for r in block_runs(lbhnc, 12)[1]], PAGE)
    in_order = np.arange(4 * 4).reshape(4, 4)  # 4 pages per block
    scattered = in_order.copy()
    scattered[1, [1, 2]] = scattered[1, [2, 1]]  # block 1's pages out of order

    blocks = np.array([5, 6, 7, 9])
    gpu = block_outermost.gpu_stretches(np.array([GPU_BASE]), blocks)
    assert np.array_equal(gpu - GPU_BASE, blocks * block_outermost.block_bytes)
    assert layer_major.gpu_stretches(np.array([GPU_BASE]), blocks) is None
    pool = layer_major.pool_stretches(POOL_BASE, in_order, PAGE)
    assert np.array_equal(pool - POOL_BASE, np.array([0, 4, 8, 12]) * PAGE)
    assert layer_major.pool_stretches(POOL_BASE, scattered, PAGE) is None


def layer_major_cache(kind: str) -> tuple[np.ndarray, SegmentTemplate]:
    """GPU memory and the template of a cache with several runs a block: vLLM 0.33's layer-major one
    (head size 32: blocks fill their pages; 40: each block's last page has an unused tail), or runs
    narrower than the GPU bytes between blocks (two runs of 2 KiB with a gap, a block every 6 KiB)."""
    if kind == "gapped":
        width = 2048
        memory = np.random.default_rng(5).integers(0, 256, 12 * 3 * width, dtype=np.uint8)
        return memory, SegmentTemplate.build([Run(0, 0, 3 * width, width), Run(0, 2 * width, 3 * width, width)], PAGE)
    buffer, views, _ = vllm_033_cache("LBHNC", head_size=int(kind.removeprefix("head")))
    return buffer.view(torch.uint8).numpy(), SegmentTemplate.build([r.run for r in block_runs(views, 12)[1]], PAGE)


@pytest.mark.parametrize("kind", ["head32", "head40", "gapped"])
def test_strided_runs_of_consecutive_blocks_move_the_same_bytes(kind):
    """Blocks 3, 4 and 5 of a cache with several runs a block, in consecutive pool pages: one 2-D copy
    per run (a row per block, rows the run's block stride apart on the GPU and a block's pages apart
    in the pool) moves exactly the bytes the kernel's segments move."""
    memory, template = layer_major_cache(kind)
    pages_per_block = -(-template.block_bytes // PAGE)
    page_ids = np.arange(8, 8 + 3 * pages_per_block).reshape(3, pages_per_block)
    blocks = np.array([3, 4, 5])
    span = pages_per_block * PAGE
    assert follow_each_other(blocks, page_ids)

    runs = template.strided_runs(np.array([GPU_BASE]), 3, POOL_BASE + 8 * PAGE)

    assert len(runs.gpu) == (2 if kind == "gapped" else 3)  # one copy per run (per layer)
    by_segment, by_copy = np.zeros(64 * PAGE, dtype=np.uint8), np.zeros(64 * PAGE, dtype=np.uint8)
    run_segments(template, memory, by_segment, blocks, page_ids)
    for gpu, gpu_pitch, host, width in zip(runs.gpu, runs.gpu_pitch, runs.pool, runs.width, strict=True):
        for row in range(len(blocks)):
            src, dst = gpu - GPU_BASE + row * gpu_pitch, host - POOL_BASE + row * span
            by_copy[dst : dst + width] = memory[src : src + width]
    assert by_copy.any() and np.array_equal(by_copy, by_segment)


def test_consecutive_blocks_follow_each_other_on_both_sides():
    pages = np.arange(12, dtype=np.uint32).reshape(3, 4)
    assert follow_each_other(np.array([7, 8, 9]), pages)
    assert follow_each_other(np.array([7]), pages[:1])
    assert not follow_each_other(np.array([7, 9, 10]), pages)  # a gap on the GPU
    assert not follow_each_other(np.array([7, 8, 9]), pages[[0, 2, 1]])  # out of order in the pool
    assert not follow_each_other(np.array([7, 8, 9]), pages * 2)  # pages further apart
    assert not follow_each_other(np.array([7, 8, 9]), np.vstack([pages[0], pages[1, ::-1], pages[2]]))  # a block's pages
    assert not follow_each_other(np.array([7, 8, 9]), pages + np.array([[0], [1], [1]], dtype=np.uint32))  # a gap between
    assert not follow_each_other(np.array([7]), np.array([[2**32 - 1, 0]], dtype=np.uint32))  # unsigned wrap-around
