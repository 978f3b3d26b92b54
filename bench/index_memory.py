"""Index cost at 1M cached blocks: bytes of memory per block and lookup time per hash.

Builds a BlockStore (the daemon's real index) with 1M committed blocks of one page each and measures
the resident-memory growth and the time of 1,024-hash lookups. Writes bench/results/index_memory.json.
Usage: python bench/index_memory.py [--blocks N]
"""

from __future__ import annotations

import hashlib
import sys
import time

import numpy as np

from common import write_result  # isort: skip

from blocks import spec  # noqa: E402

from kvtierd.block_store import BlockStore  # noqa: E402


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def main() -> None:
    blocks = int(sys.argv[sys.argv.index("--blocks") + 1]) if "--blocks" in sys.argv else 1_000_000
    hashes = [hashlib.sha256(i.to_bytes(8, "little")).digest() for i in range(blocks)]
    store = BlockStore(num_pages=blocks, page_size=4096, max_batch_blocks=4096)
    ns = store.register(spec(block_bytes=4096))
    fixed = rss_bytes()
    for start in range(0, blocks, 4096):
        batch = store.split_hashes(ns, b"".join(hashes[start : start + 4096]))  # new key objects, as in the daemon
        store.commit("bench", store.reserve("bench", ns, batch).reservation.id)
    grown = rss_bytes()
    per_block_dynamic = (grown - fixed) / blocks
    # RSS growth covers the dict entries, Block objects, hash keys and page-id strings, and the pages of the
    # per-slot numpy arrays as they are first touched.
    rng = np.random.default_rng(0)
    starts = rng.integers(0, blocks - 1024, 200)
    probes = [hashes[s : s + 1024] for s in starts.tolist()]
    for probe in probes[:20]:
        store.lookup("bench", ns, probe, pin=False)
    started = time.perf_counter()
    for probe in probes:
        assert store.lookup("bench", ns, probe, pin=False)[0] == 1024
    lookup_us_per_hash = (time.perf_counter() - started) / (len(probes) * 1024) * 1e6
    started = time.perf_counter()
    for probe in probes:
        store.release("bench", store.lookup("bench", ns, probe, pin=True)[1].id)
    pin_release_us_per_hash = (time.perf_counter() - started) / (len(probes) * 1024) * 1e6
    result = {
        "blocks": blocks,
        "index_bytes_per_block": per_block_dynamic,
        "lookup_us_per_hash": lookup_us_per_hash,
        "lookup_pin_release_us_per_hash": pin_release_us_per_hash,
    }
    command = "python bench/index_memory.py" + (f" --blocks {blocks}" if blocks != 1_000_000 else "")
    path = write_result("index_memory", result, command)
    for key, value in result.items():
        print(f"{key}: {value:.2f}" if isinstance(value, float) else f"{key}: {value}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
