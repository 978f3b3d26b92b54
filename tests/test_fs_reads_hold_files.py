"""A file that a read holds is never written over for another block, in process with the real pool,
block store, tier and files. The tier's I/O threads wait at a gate, so that a promotion's read of
block A is still to run when the demotion its own reservation causes needs room on a full disk and
evicts A: the demotion must then write a new file instead of rewriting A's (a reader that had A
open would read another block's bytes, and drop A as corrupt)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import numpy as np
import uvloop
from blocks import block_content, chain_hashes, contents, spec

from kvtier import checksum
from kvtier.pool_view import decode_page_ids
from kvtierd.block_store import BlockStore
from kvtierd.fs_format import aligned_empty, block_path, charged_bytes, read_block
from kvtierd.fs_tier import FsSettings, FsTier
from kvtierd.shm_pool import SharedPool

BLOCK = 64 << 10  # one pool page


def test_a_file_being_read_is_not_written_over_for_another_block(tmp_path):
    pool = SharedPool(Path("/dev/shm") / tmp_path.name, "kvt-reading-", 4 * BLOCK, BLOCK, 0o600)
    try:
        uvloop.run(_promote_the_block_the_full_tier_evicts(pool, tmp_path))
    finally:
        pool.close()
        (Path("/dev/shm") / tmp_path.name).rmdir()


async def _promote_the_block_the_full_tier_evicts(pool: SharedPool, tmp_path: Path) -> None:
    store = BlockStore(num_pages=4, page_size=BLOCK)  # the pool holds four blocks
    settings = FsSettings(tmp_path / "fs", 2 * charged_bytes(BLOCK), "lru", False, 2, False, 8 * BLOCK, 3600.0)
    fs = FsTier(settings, pool, store)
    fs.open()
    store.on_evict = fs.on_evict
    ns = store.register(spec(block_bytes=BLOCK))
    a, b, c, d, e, f = chain_hashes("reading", 6)

    async def put(block_hash: bytes, on_disk: int) -> None:
        """Store a block in the pool, and wait until the block it evicts is on disk."""
        data = contents([block_hash], BLOCK)
        reservation = store.reserve("s", ns, [block_hash]).reservation
        pool.view.write_blocks(decode_page_ids(reservation.page_ids, ns.pages_per_block), data)
        store.commit("s", reservation.id, checksum.block_checksums(data))
        while len(fs.index) < on_disk:
            await asyncio.sleep(0.005)

    for block_hash in (a, b, c, d):
        await put(block_hash, 0)
    await put(e, 1)  # A goes to disk, then B: the tier is full, A its least recently used
    await put(f, 2)
    old_a = block_path(settings.root, ns.id, a)
    link = tmp_path / "a.link"
    link.hardlink_to(old_a)

    gate = threading.Event()
    held = [fs.executor.submit(gate.wait) for _ in range(settings.io_threads)]
    promotion = asyncio.ensure_future(fs.promote(ns, [a]))  # its reservation evicts C; C's demotion evicts A
    await asyncio.sleep(0.05)
    assert fs.index.get(ns.id, a) is None and fs.index.inflight_bytes > 0  # A evicted, C's write waiting
    gate.set()
    await promotion
    while fs._jobs:
        await asyncio.wait(set(fs._jobs))
    assert all(h.done() for h in held)

    assert np.array_equal(np.fromfile(link, dtype=np.uint8)[-BLOCK:], block_content(a, BLOCK))  # A's file kept its bytes
    assert fs.index.counters[ns.id].checksum_failures == 0
    data = aligned_empty(BLOCK)
    read_block(block_path(settings.root, ns.id, c), ns.id, c, BLOCK, [memoryview(data)], direct=False)
    assert np.array_equal(data, block_content(c, BLOCK))  # C written in full, to a file of its own
    await fs.close(timeout=5)
