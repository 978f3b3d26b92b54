"""A client process for multi-process tests.

python worker.py ADDRESS churn SEED ITERATIONS  -- random stores/lookups/loads, verifying every byte read
python worker.py ADDRESS hold                   -- reserve and pin blocks, then wait to be killed
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))

from blocks import block_content, chain_hashes, contents, spec  # noqa: E402

from kvtier.client import KVTierClient  # noqa: E402

BLOCK_BYTES = 40_000


def churn(client: KVTierClient, seed: int, iterations: int) -> None:
    rng = np.random.default_rng(seed)
    ns = client.register(spec(block_bytes=BLOCK_BYTES))
    prefixes = [chain_hashes(f"prefix-{i}", 24) for i in range(12)]  # shared by all workers
    verified = 0
    for _ in range(iterations):
        hashes = prefixes[rng.integers(len(prefixes))][: int(rng.integers(1, 25))]
        action = rng.random()
        transport = "inline" if rng.random() < 0.3 else "shm"
        if action < 0.4:
            client.store(ns, hashes, contents(hashes, BLOCK_BYTES), transport=transport)
        else:
            loaded = client.load(ns, hashes, transport=transport)
            for i, row in enumerate(loaded):  # a visible block is always complete and correct
                if not np.array_equal(row, block_content(hashes[i], BLOCK_BYTES)):
                    raise SystemExit(f"corrupt block {hashes[i].hex()}")
            verified += len(loaded)
    print(f"ok verified={verified}", flush=True)


def hold(client: KVTierClient) -> None:
    ns = client.register(spec(block_bytes=BLOCK_BYTES))
    stored = chain_hashes("held", 4)
    client.store(ns, stored, contents(stored, BLOCK_BYTES))
    client.lookup(ns, stored, pin=True)
    reservation = client.reserve(ns, chain_hashes("half-written", 16))
    view = client.state.pool().view
    view.write_blocks(reservation.page_ids[:8], contents(chain_hashes("half-written", 8), BLOCK_BYTES))
    print("holding", flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    address, mode = sys.argv[1], sys.argv[2]
    with KVTierClient(address, engine_name=f"worker-{mode}") as c:
        if mode == "churn":
            churn(c, int(sys.argv[3]), int(sys.argv[4]))
        else:
            hold(c)
