"""LayerMajorKV copies between vLLM-CPU-layout KV tensors and pool pages, both code paths."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvtier.checksum import block_checksums  # noqa: E402
from kvtier.engine import kv_blocks  # noqa: E402
from kvtier.engine.kv_blocks import LayerMajorKV  # noqa: E402
from kvtier.pool_view import PageView  # noqa: E402

PAGE = 4096


@pytest.mark.parametrize("piece_bytes", [2 << 20, 1])  # 1: loads copy one block per piece
@pytest.mark.parametrize("head_size", [32, 20])  # 32: every layer fills whole pages; 20: staging path
def test_round_trip_through_pages(head_size, piece_bytes, monkeypatch):
    monkeypatch.setattr(kv_blocks, "CACHE_CHUNK_BYTES", piece_bytes)
    generator = torch.Generator().manual_seed(0)
    source = [torch.randn(16, 2, 32, 2 * head_size, generator=generator) for _ in range(3)]
    target = [torch.zeros_like(layer) for layer in source]
    kv_a, kv_b = LayerMajorKV(source), LayerMajorKV(target)
    assert (kv_a.block_bytes % PAGE == 0) == (head_size == 32)
    pool = PageView(bytearray(256 * PAGE), PAGE)
    pages_per_block = -(-kv_a.block_bytes // PAGE)
    page_ids = np.random.default_rng(0).permutation(256)[: 4 * pages_per_block].astype(np.uint32).reshape(4, pages_per_block)

    stored = kv_a.write_pool(pool, page_ids, kv_a.snapshot([1, 5, 9, 15]))
    whole_blocks = pool.read_blocks(page_ids, kv_a.block_bytes)
    assert np.array_equal(stored, block_checksums(whole_blocks))
    expected = torch.cat([layer.view(torch.uint8).reshape(16, -1)[[1, 5, 9, 15]] for layer in source], dim=1).numpy()
    assert np.array_equal(whole_blocks, expected)

    loaded = kv_b.read_pool(pool, page_ids, [0, 2, 4, 6])
    assert np.array_equal(loaded, stored)
    for a, b in zip(source, target, strict=True):
        assert torch.equal(a[[1, 5, 9, 15]], b[[0, 2, 4, 6]])
        assert not b[1].any()  # other blocks untouched


def test_rejects_unsupported_layouts():
    with pytest.raises(ValueError, match="unsupported KV layout"):
        LayerMajorKV([torch.zeros(4, 2, 8, 8).transpose(1, 2)])
    with pytest.raises(ValueError, match="no KV cache layers"):
        LayerMajorKV([])
