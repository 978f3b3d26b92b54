"""Filesystem tier throughput against a plain sequential O_DIRECT write/read of the same bytes on the
same disk, in one run, plus restart (re-indexing) time for 100k and 1M blocks.

- Baseline ("dd"): one thread writes the data set to one file in 2 MiB O_DIRECT writes and fsyncs it
  (like `dd oflag=direct conv=fsync bs=2M`), then reads it back with O_DIRECT (so the page cache, which
  cannot be dropped without root, plays no part).
- Tier write: an engine stores 2 MiB blocks through a 256 MiB pool; everything the pool evicts is
  demoted (--fs-direct-io). Throughput = demoted bytes / time from the first store until the last file
  is complete (fsync'd, renamed, directory fsync'd).
- Tier read: the pool is emptied of those blocks, then pinned lookups of 64 blocks promote them from
  disk (O_DIRECT reads straight into pool pages, xxh3 verified) and release them; throughput = bytes /
  time. A sample is then loaded and compared byte-exact.
- Restart: a tier directory with N small (512-byte) block files, written with the tier's own writer
  without fsync to fill it quickly; time from starting the daemon until it serves, and the time its
  "fs tier indexed" log line reports; then a lookup of indexed blocks must hit and load byte-exact.

Needs about 2 x DATA_BYTES + 5 GB free on the disk of --dir (checked first). Usage:
python bench/fs_tier.py [--dir DIR] [--quick]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from common import start_daemon, stop_daemon, write_result  # isort: skip

from blocks import chain_hashes, contents, spec  # noqa: E402

from kvtier.client import KVTierClient  # noqa: E402
from kvtier.v1 import kvtier_pb2 as pb  # noqa: E402
from kvtierd.fs_format import aligned_empty, block_path, write_block, write_spec  # noqa: E402
from kvtierd.namespace import namespace_digest  # noqa: E402

BLOCK = 2 << 20
POOL = 256 << 20
LOAD_BATCH = 64
SMALL_BLOCK = 512
GB = 1e9


def baseline(directory: Path, data: np.ndarray, total: int) -> tuple[float, float]:
    """GB/s of one O_DIRECT sequential write (then fsync) and read of `total` bytes in BLOCK pieces."""
    path = directory / "baseline.bin"
    buffer = aligned_empty(BLOCK)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
    started = time.perf_counter()
    for i, offset in enumerate(range(0, total, BLOCK)):
        buffer[:] = data[i % len(data)]
        os.pwritev(fd, [memoryview(buffer)], offset)
    os.fsync(fd)
    os.close(fd)
    write_s = time.perf_counter() - started
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    started = time.perf_counter()
    for offset in range(0, total, BLOCK):
        assert os.preadv(fd, [memoryview(buffer)], offset) == BLOCK
    read_s = time.perf_counter() - started
    os.close(fd)
    path.unlink()
    return total / write_s / GB, total / read_s / GB


def fs_stats(daemon) -> pb.TierStats:
    return next(t for t in daemon.admin("GetStats").tiers if t.tier == "fs")


def tier(directory: Path, data: np.ndarray, count: int, threads: int) -> dict:
    fs_dir = directory / "tier"
    daemon = start_daemon(
        *("--pool-size", str(POOL), "--fs-path", str(fs_dir), "--fs-size", str(2 * count * BLOCK)),
        *("--fs-direct-io", "true", "--fs-io-threads", str(threads), "--fs-queue-size", str(count * BLOCK)),
        *("--log-level", "warning", "--lease-ttl", "120"),
    )
    try:
        with KVTierClient(daemon.address, engine_name="bench", timeout=120) as client:
            ns = client.register(spec(block_bytes=BLOCK))
            in_pool = POOL // BLOCK
            hashes = chain_hashes("fs-bench", count + in_pool)

            def store(start: int, end: int) -> None:
                for first in range(start, end, 16):
                    batch = hashes[first : min(first + 16, end)]
                    client.store(ns, batch, data[np.arange(first, first + len(batch)) % len(data)])

            store(0, in_pool)  # fill the pool (nothing to demote yet)
            started = time.perf_counter()
            store(in_pool, count + in_pool)  # each block stored evicts one: `count` demotions
            demoted = count
            while (stats := fs_stats(daemon)).stored_blocks < demoted:
                time.sleep(0.005)
            write_s = time.perf_counter() - started
            assert stats.stored_blocks == demoted and stats.blocks == demoted, stats
            # The pool's own blocks are not on disk: delete them so the read phase evicts nothing to write.
            client.admin.DeleteBlocks(pb.DeleteBlocksRequest(namespace=ns.id, hashes=b"".join(hashes[demoted:])))
            started = time.perf_counter()
            for start in range(0, demoted, LOAD_BATCH):
                result = client.lookup(ns, hashes[start : start + LOAD_BATCH], pin=True)
                assert result.hit_count == min(LOAD_BATCH, demoted - start), result.hit_count
                client.release(result.lease_id)
            read_s = time.perf_counter() - started
            assert fs_stats(daemon).loaded_blocks == demoted
            for start in (0, demoted // 2, demoted - 8):  # what was promoted is byte-exact
                expected = data[np.arange(start, start + 8) % len(data)]
                assert np.array_equal(client.load(ns, hashes[start : start + 8]), expected)
        return {
            "blocks_demoted": demoted,
            "tier_write_GBps": demoted * BLOCK / write_s / GB,
            "tier_read_GBps": demoted * BLOCK / read_s / GB,
        }
    finally:
        stop_daemon(daemon)
        shutil.rmtree(fs_dir, ignore_errors=True)


def fill(fs_dir: Path, count: int) -> tuple[pb.NamespaceSpec, list[bytes]]:
    """`count` valid block files (real headers and checksums; not fsync'd), in the tier's layout."""
    small = spec(block_bytes=SMALL_BLOCK, model_id=f"restart-{count}")
    digest = namespace_digest(small)
    write_spec(fs_dir, small)
    hashes = chain_hashes(f"restart-{count}", count)
    payload = [memoryview(b) for b in contents(hashes[:64], SMALL_BLOCK)]

    def write(start: int) -> None:
        for i in range(start, min(start + 4096, count)):
            path = block_path(fs_dir, digest, hashes[i])
            write_block(path, digest, hashes[i], SMALL_BLOCK, 0, time.time(), [payload[i % 64]], False, False)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(write, range(0, count, 4096)))
    return small, hashes


def restart(directory: Path, count: int) -> dict:
    fs_dir = directory / f"restart-{count}"
    small, hashes = fill(fs_dir, count)
    started = time.perf_counter()
    daemon = start_daemon("--pool-size", "64MiB", "--fs-path", str(fs_dir), "--fs-size", str(count * 8192), "--log-level", "info")
    serving_s = time.perf_counter() - started
    try:
        indexed = re.search(r"fs tier indexed .*blocks=(\d+) .*seconds=([\d.]+)", daemon.log())
        assert indexed and int(indexed.group(1)) == count, daemon.log()[-2000:]
        with KVTierClient(daemon.address, engine_name="bench") as client:
            ns = client.register(small)
            middle = count // 2
            sample = hashes[middle : middle + 64]
            assert client.lookup(ns, sample).hit_count == 64
            expected = contents(hashes[:64], SMALL_BLOCK)[np.arange(middle, middle + 64) % 64]
            assert np.array_equal(client.load(ns, sample), expected)
        return {"blocks": count, "start_to_serving_s": serving_s, "index_s": float(indexed.group(2))}
    finally:
        stop_daemon(daemon)
        shutil.rmtree(fs_dir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, default=Path("/tmp"), help="a directory on the disk to measure")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--io-threads", type=int, default=8)
    args = parser.parse_args()
    count = 256 if args.quick else 1024  # blocks of 2 MiB: 2 GiB, 8x the pool
    restarts = (10_000,) if args.quick else (100_000, 1_000_000)
    needed = 2 * count * BLOCK + max(restarts) * 4096 + (1 << 30)
    free = shutil.disk_usage(args.dir).free
    if free < needed:
        sys.exit(f"fs_tier bench: {args.dir} has {free / GB:.1f} GB free, needs {needed / GB:.1f} GB")
    directory = Path(tempfile.mkdtemp(prefix="kvt-fsbench-", dir=args.dir))
    try:
        data = contents(chain_hashes("fs-bench-data", 32), BLOCK)
        dd_write, dd_read = baseline(directory, data, count * BLOCK)
        result: dict = {"block_bytes": BLOCK, "data_bytes": count * BLOCK, "io_threads": args.io_threads}
        result |= {"dd_write_GBps": dd_write, "dd_read_GBps": dd_read}
        result |= tier(directory, data, count, args.io_threads)
        result["write_ratio"] = result["tier_write_GBps"] / dd_write
        result["read_ratio"] = result["tier_read_GBps"] / dd_read
        result["restart"] = [restart(directory, n) for n in restarts]
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    command = "python bench/fs_tier.py " + " ".join(sys.argv[1:])
    print(write_result("fs_tier" if not args.quick else "fs_tier_quick", result, command.strip()).read_text())


if __name__ == "__main__":
    main()
