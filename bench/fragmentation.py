"""Pool waste under a mixed workload: namespaces with different block sizes share one pool.

Runs the daemon's real index over a 1 GiB pool (32 KiB pages) with four block sizes, random store
batches, hot-prefix lookups and eviction, and reports how much of the pool holds no block bytes
(tail waste of each block's last page plus free pages). Writes bench/results/fragmentation.json.
Usage: python bench/fragmentation.py
"""

from __future__ import annotations

import numpy as np

from common import write_result  # isort: skip

from blocks import spec  # noqa: E402

from kvtierd.block_store import BlockStore  # noqa: E402

PAGE = 32 << 10
POOL = 1 << 30
SIZES = {"llama-8b-gpu": 2 << 20, "qwen-small": 640 << 10, "cpu-tiny": 160 << 10, "odd-size": (2 << 20) + (12 << 10)}
STEPS = 20_000


def main() -> None:
    store = BlockStore(num_pages=POOL // PAGE, page_size=PAGE, eviction="lru")
    namespaces = [store.register(spec(block_bytes=size, model_id=name)) for name, size in SIZES.items()]
    rng = np.random.default_rng(7)
    prefixes = [[rng.bytes(32) for _ in range(64)] for _ in range(400)]  # shared prompt prefixes
    waste, unused = [], []
    for step in range(STEPS):
        ns = namespaces[rng.integers(len(namespaces))]
        prefix = prefixes[min(int(rng.zipf(1.3)) - 1, len(prefixes) - 1)]
        length = int(rng.integers(1, 64))
        hashes = [ns.id.encode()[:8] + h[8:] for h in prefix[:length]]
        hit, _ = store.lookup("bench", ns, hashes, pin=False)
        if hit < length:
            result = store.reserve("bench", ns, hashes[hit:])
            if result.reservation is not None:
                store.commit("bench", result.reservation.id)
        if step >= STEPS // 10:
            stored = sum(len(n.blocks) * n.block_bytes for n in namespaces)
            held = store.pages.used * PAGE
            waste.append(1 - stored / held)
            unused.append(1 - stored / POOL)
    evictions = sum(n.counters.evictions for n in namespaces)
    result = {
        "pool_bytes": POOL,
        "page_bytes": PAGE,
        "block_sizes": SIZES,
        "steps": STEPS,
        "evictions": evictions,
        "held_but_unused_fraction_mean": float(np.mean(waste)),
        "held_but_unused_fraction_max": float(np.max(waste)),
        "pool_not_holding_block_bytes_fraction_mean": float(np.mean(unused)),
        "pool_not_holding_block_bytes_fraction_max": float(np.max(unused)),
    }
    path = write_result("fragmentation", result, "python bench/fragmentation.py")
    for key, value in result.items():
        print(f"{key}: {value}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
