"""Filesystem tier throughput against plain O_DIRECT writes and reads of the same bytes on the same disk,
in one run, plus restart (re-indexing) time for 100k and 1M blocks.

- Baselines: DATA_BYTES written to ONE file in 2 MiB O_DIRECT writes, then one fsync, and read back with
  O_DIRECT: "dd" from one thread (`dd oflag=direct conv=fsync bs=2M`, `dd iflag=direct`), "parallel"
  from --io-threads threads (reported, not used in ratios). The tier does strictly more for the same
  bytes: one file per block, each fsync'd and renamed.
- Write ratios are paired: this disk's speed drifts by tens of percent within minutes, so every timed
  round of the tier follows a dd burst of the same BURST blocks (one file, O_DIRECT, one fsync) on the
  same disk, and a ratio is the dd bursts' seconds over the tier rounds' seconds (`paired_dd_*`). Both
  start from a synced filesystem (os.sync() untimed before each), so neither pays for the other's
  background writeback or discards.
- Demotion (the headline `tier_write_GBps`): the tier's own throughput. Each round fills a pool of
  BURST blocks (untimed), then one reservation of BURST new blocks evicts them all at once; timed from
  before that reservation (the copy out of the pool included) until the tier counts every file stored
  (written, fsync'd, renamed). The first round warms the staging buffers and is reported apart
  (`tier_write_first_burst_GBps`).
- Full tier (`full_tier_*`, also alone with --full-tier-only into fs_tier_full.json): demotion as
  above into a tier of 2 * BURST blocks, full after two rounds, so each later burst evicts as many
  blocks and the new blocks are written over their files (no new space to allocate). Paired with a
  dd burst to a new file and one over a file written before (`dd conv=notrunc`): the fair baseline
  for writes into allocated space.
- Write-through: rounds of BURST blocks written into the pool by the client (untimed) and committed in
  one call; timed from the commit until every file is stored.
- Store and demote (`store_and_demote_GBps`): end to end, two client threads store into a full 256 MiB
  pool so every store evicts as much as it adds; timed from the first store until the last file is
  stored. On this 2-core machine the engine's stores (~1 GB/s alone) share the cores with the tier, so
  this is bounded by the CPU, not by the tier or the disk.
- Tier read: the demoted blocks, dropped from the page cache first (posix_fadvise DONTNEED), promoted by
  pinned lookups of 64 blocks (O_DIRECT reads into pool pages, in parallel on the I/O threads, xxh3
  verified), in chunks of BURST blocks, each after a dd read (O_DIRECT, one thread) of the dd burst
  written just before those blocks were demoted, so both are as old (a file written just before
  its read can come from the virtual disk's host cache: 2.25 GB/s against 0.9-1.0 from the disk);
  the ratio is paired like the writes. A sample is then loaded and compared byte-exact.
- Files: the same pairing with a plain reader of files laid out like the tier's (`paired_files_*`):
  each demotion round also writes BURST files of one block each (16 threads, O_DIRECT, each
  fsync'd; untimed), after the dd burst, and each chunk's tier read follows a sequential read of
  those files from one thread (O_DIRECT). A file per block is what the tier stores, so this ratio
  leaves out what that layout costs (on this disk about nothing: this reader gets what dd gets):
  it is the daemon's own cost (lookups, promotion, verification, a batch's files read in parallel).
- Restart: a tier directory with N small (512-byte) block files, written with the tier's own writer
  without fsync to fill it quickly; time from starting the daemon until it serves, and the time its
  "fs tier indexed" log line reports; then a lookup of indexed blocks must hit and load byte-exact.

Needs about 4 x DATA_BYTES + 5 GB free on the disk of --dir (checked first). Usage:
python bench/fs_tier.py [--dir DIR] [--quick]
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import shutil
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import grpc
import numpy as np

from common import start_daemon, stop_daemon, write_result  # isort: skip

from blocks import chain_hashes, contents, spec  # noqa: E402

from kvtier.client import KVTierClient  # noqa: E402
from kvtier.v1 import kvtier_pb2 as pb  # noqa: E402
from kvtier.v1 import kvtier_pb2_grpc as pb_grpc  # noqa: E402
from kvtierd.fs_format import aligned_empty, block_path, fsync_directory, write_block_file, write_spec  # noqa: E402
from kvtierd.fs_snapshot import RACY_SECONDS  # noqa: E402
from kvtierd.namespace import namespace_digest  # noqa: E402

BLOCK = 2 << 20
POOL = 256 << 20
LOAD_BATCH = 64
BURST = 256  # blocks evicted at once in the demotion measurement (512 MiB)
SMALL_BLOCK = 512
POLL_S = 0.005  # between GetStats calls while waiting for files to be stored
GB = 1e9


def baseline(directory: Path, data: np.ndarray, total: int, threads: int) -> dict:
    """GB/s of writing `total` bytes to one file in BLOCK-sized O_DIRECT writes, then one fsync, and of
    reading them back with O_DIRECT: sequentially from one thread (as `dd oflag=direct conv=fsync bs=2M`,
    then `dd iflag=direct`) and from `threads` threads at once (each piece at its own offset). Then
    "files": the same bytes as one file per BLOCK (create, O_DIRECT write, fsync, close) from `threads`
    threads, and one fsync of their directory."""
    path = directory / "baseline.bin"
    pieces = [(offset, memoryview(data[i % len(data)])) for i, offset in enumerate(range(0, total, BLOCK))]
    result = {}
    for name, workers in (("dd", 1), ("parallel", threads)):
        write_s = timed_write(path, pieces, workers)
        read_s = timed_read(path, len(pieces), workers)
        path.unlink()
        result |= {f"{name}_write_GBps": total / write_s / GB, f"{name}_read_GBps": total / read_s / GB}
    files = directory / "files"
    files.mkdir()
    with ThreadPoolExecutor(threads) as pool:
        started = time.perf_counter()
        list(pool.map(partial(_write_file, files), range(len(pieces)), [piece for _, piece in pieces]))
        fsync_directory(files)
        result["files_write_GBps"] = total / (time.perf_counter() - started) / GB
    shutil.rmtree(files)
    return result


def timed_write(path: Path, pieces: list[tuple[int, memoryview]], workers: int, over: bool = False) -> float:
    """Seconds to write `pieces` (offset, bytes) to a new file at `path` (or with `over`, over the
    existing file, whose space stays allocated) with O_DIRECT from `workers` threads, then fsync it;
    the file is left in place."""
    flags = os.O_WRONLY | os.O_DIRECT | (0 if over else os.O_CREAT | os.O_TRUNC)
    fd = os.open(path, flags, 0o600)
    try:
        with ThreadPoolExecutor(workers) as pool:
            started = time.perf_counter()
            list(pool.map(partial(_write_piece, fd), pieces))
            os.fsync(fd)
            return time.perf_counter() - started
    finally:
        os.close(fd)


def timed_read(path: Path, blocks: int, workers: int) -> float:
    """Seconds to read the first `blocks` BLOCKs of `path` with O_DIRECT from `workers` threads."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    targets = [memoryview(aligned_empty(BLOCK)) for _ in range(workers)]
    try:
        with ThreadPoolExecutor(workers) as pool:
            started = time.perf_counter()
            read = list(pool.map(partial(_read_piece, fd, targets), range(blocks)))
            seconds = time.perf_counter() - started
    finally:
        os.close(fd)
    assert read == [BLOCK] * blocks
    return seconds


def dd_burst(directory: Path, data: np.ndarray, keep_as: Path | None = None, over: Path | None = None) -> float:
    """Seconds for a dd-style write of BURST blocks (one thread, O_DIRECT, one fsync) to a new file,
    then removed or renamed to `keep_as` (to be read back later); or over the file `over`
    (`dd conv=notrunc`), which stays."""
    path = over or directory / "dd-burst.bin"
    os.sync()
    seconds = timed_write(path, [(i * BLOCK, memoryview(data[i % len(data)])) for i in range(BURST)], 1, over=over is not None)
    if over is not None:
        return seconds
    if keep_as is None:
        path.unlink()
    else:
        path.rename(keep_as)
    return seconds


def files_burst(directory: Path, data: np.ndarray, threads: int) -> None:
    """BURST files of one block each in `directory` (created), as baseline() writes them."""
    directory.mkdir()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(partial(_write_file, directory), range(BURST), [memoryview(data[i % len(data)]) for i in range(BURST)]))
    fsync_directory(directory)


def timed_files_read(directory: Path) -> float:
    """Seconds to read the files of `files_burst` one after another from one thread, with O_DIRECT."""
    target = memoryview(aligned_empty(BLOCK))
    started = time.perf_counter()
    for i in range(BURST):
        fd = os.open(directory / f"{i}.blk", os.O_RDONLY | os.O_DIRECT)
        try:
            assert os.preadv(fd, [target], 0) == BLOCK
        finally:
            os.close(fd)
    return time.perf_counter() - started


def _write_file(directory: Path, i: int, piece: memoryview) -> None:
    fd = os.open(directory / f"{i}.blk", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    try:
        os.pwritev(fd, [piece], 0)
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_piece(fd: int, piece: tuple[int, memoryview]) -> int:
    return os.pwritev(fd, [piece[1]], piece[0])


def _read_piece(fd: int, targets: list[memoryview], i: int) -> int:
    return os.preadv(fd, [targets[i % len(targets)]], i * BLOCK)


@functools.cache
def admin_stub(address: str) -> pb_grpc.KVTierAdminStub:
    """One channel per daemon for the polls: a new connection per poll (daemon.admin) costs both
    processes CPU that the tier's own threads then lack."""
    return pb_grpc.KVTierAdminStub(grpc.insecure_channel(address))


def fs_stats(daemon) -> pb.TierStats:
    return next(t for t in admin_stub(daemon.address).GetStats(pb.GetStatsRequest(), timeout=10).tiers if t.tier == "fs")


def wait_stored(daemon, blocks: int) -> pb.TierStats:
    """Poll until the tier counts `blocks` stored; a timed wait overshoots by at most one POLL_S."""
    while (stats := fs_stats(daemon)).stored_blocks < blocks:
        time.sleep(POLL_S)
    return stats


def timed_eviction(client, daemon, ns, hashes: list[bytes], stored: int) -> tuple[float, pb.TierStats]:
    """From a synced filesystem, seconds from a reservation of `hashes` (which evicts the full pool's
    blocks) until the tier counts `stored` blocks stored; the reservation is then aborted, so the pool
    is empty again and every block is on disk only."""
    os.sync()
    started = time.perf_counter()
    reservation = client.reserve(ns, hashes)
    stats = wait_stored(daemon, stored)
    seconds = time.perf_counter() - started
    client.abort(reservation.id)
    return seconds, stats


def fs_daemon(fs_dir: Path, pool_blocks: int, disk_blocks: int, threads: int, *args: str):
    return start_daemon(
        *("--pool-size", str(pool_blocks * BLOCK), "--fs-path", str(fs_dir), "--fs-size", str(disk_blocks * (BLOCK + 4096))),
        *("--fs-direct-io", "true", "--fs-io-threads", str(threads), "--fs-queue-size", str(pool_blocks * BLOCK)),
        *("--log-level", "warning", "--lease-ttl", "600", *args),
    )


def blocks_of(data: np.ndarray, first: int, n: int) -> np.ndarray:
    return data[np.arange(first, first + n) % len(data)]


def store(client, ns, hashes: list[bytes], data: np.ndarray, start: int, end: int, batch: int = 16) -> None:
    for first in range(start, end, batch):
        client.store(ns, hashes[first : min(first + batch, end)], blocks_of(data, first, min(batch, end - first)))


def demotion(directory: Path, data: np.ndarray, count: int, threads: int) -> dict:
    """Demotion itself, then promotion. In each round a pool of BURST blocks is filled (untimed), then one
    reservation of BURST new blocks makes the pool evict all of them at once; timed from just before that
    reservation (so the copy out of the pool is included) until the tier counts every file stored
    (written, fsync'd, renamed). The first round warms the tier's staging buffers (first-touching fresh
    memory is slow on this VM) and is reported apart; the next rounds demote `count` blocks in all."""
    fs_dir = directory / "demotion"
    daemon = fs_daemon(fs_dir, BURST, count + BURST, threads)
    try:
        with KVTierClient(daemon.address, engine_name="bench", timeout=600) as client:
            ns = client.register(spec(block_bytes=BLOCK))
            hashes = chain_hashes("fs-bench", 2 * (count + BURST))
            seconds, dd_seconds, dd_files, file_dirs = [], [], [], []
            for first in range(0, len(hashes), 2 * BURST):
                store(client, ns, hashes, data, first, first + BURST)  # fills the pool; nothing is evicted
                demoted = first // 2
                assert fs_stats(daemon).stored_blocks == demoted
                dd_files.append(directory / f"dd-read-{len(dd_files)}.bin")
                dd_seconds.append(dd_burst(directory, data, keep_as=dd_files[-1]))
                file_dirs.append(directory / f"files-read-{len(file_dirs)}")
                files_burst(file_dirs[-1], data, threads)
                took, stats = timed_eviction(client, daemon, ns, hashes[first + BURST : first + 2 * BURST], demoted + BURST)
                seconds.append(took)
            assert stats.stored_blocks == stats.blocks == count + BURST, stats
            drop_from_page_cache(fs_dir)
            on_disk = [h for i in range(0, len(hashes), 2 * BURST) for h in hashes[i : i + BURST]][BURST:]
            read_seconds, dd_read_seconds, files_read_seconds = [], [], []
            for chunk, dd_file, file_dir in zip(range(0, count, BURST), dd_files[1:], file_dirs[1:], strict=True):
                # each chunk of BURST blocks follows a dd read of the burst written just before them,
                # then a read of the files written just before them
                dd_read_seconds.append(timed_read(dd_file, BURST, 1))
                dd_file.unlink()
                files_read_seconds.append(timed_files_read(file_dir))
                shutil.rmtree(file_dir)
                started = time.perf_counter()
                for start in range(chunk, chunk + BURST, LOAD_BATCH):
                    result = client.lookup(ns, on_disk[start : start + LOAD_BATCH], pin=True)
                    assert result.hit_count == LOAD_BATCH, result.hit_count
                    client.release(result.lease_id)
                read_seconds.append(time.perf_counter() - started)
            dd_files[0].unlink()
            shutil.rmtree(file_dirs[0])
            assert fs_stats(daemon).loaded_blocks == count
            for start in (0, count // 2, count - 8):  # what was promoted is byte-exact
                loaded = client.load(ns, on_disk[start : start + 8])
                assert np.array_equal(loaded, contents_of(data, hashes, on_disk[start : start + 8]))
        return {
            "tier_write_GBps": count * BLOCK / sum(seconds[1:]) / GB,
            "paired_dd_write_GBps": count * BLOCK / sum(dd_seconds[1:]) / GB,
            "write_ratio": sum(dd_seconds[1:]) / sum(seconds[1:]),
            "write_ratio_by_round": [dd / tier for dd, tier in zip(dd_seconds[1:], seconds[1:], strict=True)],
            "tier_write_first_burst_GBps": BURST * BLOCK / seconds[0] / GB,
            "demotion_burst_blocks": BURST,
            "tier_read_GBps": count * BLOCK / sum(read_seconds) / GB,
            "paired_dd_read_GBps": count * BLOCK / sum(dd_read_seconds) / GB,
            "read_ratio": sum(dd_read_seconds) / sum(read_seconds),
            "read_ratio_by_round": [dd / tier for dd, tier in zip(dd_read_seconds, read_seconds, strict=True)],
            "paired_files_read_GBps": count * BLOCK / sum(files_read_seconds) / GB,
            "read_ratio_to_files": sum(files_read_seconds) / sum(read_seconds),
            "read_ratio_to_files_by_round": [f / tier for f, tier in zip(files_read_seconds, read_seconds, strict=True)],
        }
    finally:
        stop_daemon(daemon)
        shutil.rmtree(fs_dir, ignore_errors=True)


def full_tier_demotion(directory: Path, data: np.ndarray, rounds: int, threads: int) -> dict:
    """Demotion into a full tier, as in steady state: the tier holds 2 * BURST blocks, so from the third
    round on each burst of BURST demotions evicts as many blocks, whose files the new blocks are
    written over. Timed like `demotion`; each timed round is paired with a dd burst to a new file and
    one over a file dd wrote before (its space allocated, like the evicted blocks' files)."""
    fs_dir = directory / "full"
    daemon = fs_daemon(fs_dir, BURST, 2 * BURST, threads)
    over = directory / "dd-over.bin"
    dd_burst(directory, data, keep_as=over)
    try:
        with KVTierClient(daemon.address, engine_name="bench", timeout=600) as client:
            ns = client.register(spec(block_bytes=BLOCK))
            hashes = chain_hashes("fs-bench-full", 2 * (rounds + 2) * BURST)
            seconds, dd_seconds, dd_over_seconds = [], [], []
            for first in range(0, len(hashes), 2 * BURST):
                store(client, ns, hashes, data, first, first + BURST)  # fills the pool; nothing is evicted
                dd_seconds.append(dd_burst(directory, data))
                dd_over_seconds.append(dd_burst(directory, data, over=over))
                took, stats = timed_eviction(client, daemon, ns, hashes[first + BURST : first + 2 * BURST], first // 2 + BURST)
                seconds.append(took)
            assert stats.blocks == 2 * BURST and stats.evictions == rounds * BURST, stats
            on_disk = hashes[-2 * BURST : -BURST]  # the last round's blocks
            loaded = client.load(ns, on_disk[:8])
            assert np.array_equal(loaded, contents_of(data, hashes, on_disk[:8]))
        timed = slice(2, None)  # the first two rounds fill the tier
        return {
            "full_tier_write_GBps": rounds * BURST * BLOCK / sum(seconds[timed]) / GB,
            "full_tier_paired_dd_write_GBps": rounds * BURST * BLOCK / sum(dd_seconds[timed]) / GB,
            "full_tier_paired_dd_overwrite_GBps": rounds * BURST * BLOCK / sum(dd_over_seconds[timed]) / GB,
            "full_tier_write_ratio": sum(dd_seconds[timed]) / sum(seconds[timed]),
            "full_tier_write_ratio_to_overwrite": sum(dd_over_seconds[timed]) / sum(seconds[timed]),
            "full_tier_write_ratio_by_round": [d / t for d, t in zip(dd_seconds[timed], seconds[timed], strict=True)],
            "full_tier_rounds": rounds,
        }
    finally:
        stop_daemon(daemon)
        shutil.rmtree(fs_dir, ignore_errors=True)
        over.unlink(missing_ok=True)


def contents_of(data: np.ndarray, hashes: list[bytes], wanted: list[bytes]) -> np.ndarray:
    position = {h: i for i, h in enumerate(hashes)}
    return data[np.array([position[h] for h in wanted]) % len(data)]


def write_through(directory: Path, data: np.ndarray, count: int, threads: int) -> dict:
    """--fs-write-through: in each round the client reserves BURST blocks and writes them into the pool
    (untimed; the reservation evicts the previous round's blocks, already on disk), then commits them in
    one call; timed from just before the commit until the tier counts every file stored. The first
    round (the daemon's first touch of the pool's pages) is a warm-up, left out."""
    fs_dir = directory / "write-through"
    daemon = fs_daemon(fs_dir, BURST, count + BURST, threads, "--fs-write-through", "true")
    try:
        with KVTierClient(daemon.address, engine_name="bench", timeout=600) as client:
            ns = client.register(spec(block_bytes=BLOCK))
            hashes = chain_hashes("fs-bench-wt", count + BURST)
            seconds, dd_seconds = [], []
            for first in range(0, len(hashes), BURST):
                reservation = client.reserve(ns, hashes[first : first + BURST])
                view = client.state.pool().view
                for chunk in range(0, BURST, 64):
                    view.write_blocks(reservation.page_ids[chunk : chunk + 64], blocks_of(data, first + chunk, 64))
                dd_seconds.append(dd_burst(directory, data))
                os.sync()
                started = time.perf_counter()
                client.commit(reservation.id)
                stats = wait_stored(daemon, first + BURST)
                seconds.append(time.perf_counter() - started)
            assert stats.blocks == count + BURST, stats
        return {
            "write_through_GBps": count * BLOCK / sum(seconds[1:]) / GB,
            "write_through_ratio": sum(dd_seconds[1:]) / sum(seconds[1:]),
            "write_through_ratio_by_round": [dd / tier for dd, tier in zip(dd_seconds[1:], seconds[1:], strict=True)],
        }
    finally:
        stop_daemon(daemon)
        shutil.rmtree(fs_dir, ignore_errors=True)


def streaming(directory: Path, data: np.ndarray, count: int, threads: int, clients: int) -> dict:
    """End to end: `clients` threads store `count` blocks into a full 256 MiB pool, so every store
    evicts as many blocks as it adds; timed from the first store until the last demoted file is
    stored. Both the engine's stores and the demotions run on this machine's cores. When the engines
    outrun the disk by more than --fs-queue-size (here the pool's size), the tier drops victims
    rather than stall them; those are counted (`store_and_demote_skipped_blocks`), not timed."""
    fs_dir = directory / "streaming"
    daemon = fs_daemon(fs_dir, POOL // BLOCK, count, threads)
    try:
        with KVTierClient(daemon.address, engine_name="bench", timeout=600) as client:
            ns = client.register(spec(block_bytes=BLOCK))
            in_pool = POOL // BLOCK
            hashes = chain_hashes("fs-bench-stream", count + in_pool)
            store(client, ns, hashes, data, 0, in_pool)
        bounds = np.linspace(in_pool, in_pool + count, clients + 1).astype(int).tolist()

        def run(start: int, end: int) -> None:
            with KVTierClient(daemon.address, engine_name="bench", timeout=600) as client:
                store(client, client.register(spec(block_bytes=BLOCK)), hashes, data, start, end)

        started = time.perf_counter()
        with ThreadPoolExecutor(clients) as pool:
            list(pool.map(run, bounds[:-1], bounds[1:]))
        while (stored := fs_stats(daemon).stored_blocks) + (skipped := skipped_blocks(daemon)) < count:
            time.sleep(POLL_S)
        seconds = time.perf_counter() - started
        assert fs_stats(daemon).blocks == stored == count - skipped
        return {
            "store_and_demote_GBps": stored * BLOCK / seconds / GB,
            "store_and_demote_skipped_blocks": skipped,
            "store_clients": clients,
        }
    finally:
        stop_daemon(daemon)
        shutil.rmtree(fs_dir, ignore_errors=True)


def skipped_blocks(daemon) -> int:
    """Blocks the tier did not write (kvtierd_fs_skipped_blocks_total, all reasons)."""
    port = admin_stub(daemon.address).GetInfo(pb.GetInfoRequest(), timeout=10).metrics_port
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    return int(sum(float(v) for v in re.findall(r"^kvtierd_fs_skipped_blocks_total\{[^}]*\} (\S+)$", metrics, re.M)))


def drop_from_page_cache(root: Path) -> None:
    """Evict the tier's files from the page cache (no root needed), so reads come from the disk."""
    for path in root.rglob("*.kvb"):
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


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
            write_block_file(path, digest, hashes[i], SMALL_BLOCK, 0, time.time(), [payload[i % 64]], False, durable=False)

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(write, range(0, count, 4096)))
    return small, hashes


def restart(directory: Path, count: int) -> dict:
    """Start a daemon on `count` block files with no index file (every directory listed), stop it cleanly
    (it writes the index file), then start one again (directories taken from the index file). The
    files are left to settle first: an index file leaves out directories changed within RACY_SECONDS,
    and on a fast machine the first daemon can start and stop within that of the last file."""
    fs_dir = directory / f"restart-{count}"
    small, hashes = fill(fs_dir, count)
    time.sleep(RACY_SECONDS)
    result: dict = {"blocks": count}
    try:
        for how in ("listing", "index_file"):
            started = time.perf_counter()
            daemon = start_daemon(
                "--pool-size", "64MiB", "--fs-path", str(fs_dir), "--fs-size", str(count * 8192), "--log-level", "info"
            )
            serving_s = time.perf_counter() - started
            try:
                indexed = re.search(
                    r"fs tier indexed .*blocks=(\d+) .*directories_from_index_file=(\d+) .*seconds=([\d.]+)", daemon.log()
                )
                assert indexed and int(indexed.group(1)) == count, daemon.log()[-2000:]
                assert int(indexed.group(2)) == (16 if how == "index_file" else 0), indexed.group(0)
                with KVTierClient(daemon.address, engine_name="bench") as client:
                    ns = client.register(small)
                    middle = count // 2
                    sample = hashes[middle : middle + 64]
                    assert client.lookup(ns, sample).hit_count == 64
                    expected = contents(hashes[:64], SMALL_BLOCK)[np.arange(middle, middle + 64) % 64]
                    assert np.array_equal(client.load(ns, sample), expected)
                result |= {f"{how}_start_to_serving_s": serving_s, f"{how}_index_s": float(indexed.group(3))}
            finally:
                stop_daemon(daemon)
    finally:
        shutil.rmtree(fs_dir, ignore_errors=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, default=Path("/tmp"), help="a directory on the disk to measure")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--io-threads", type=int, default=16)
    parser.add_argument("--full-tier-only", action="store_true", help="only the full tier's demotion (fs_tier_full.json)")
    args = parser.parse_args()
    count = 256 if args.quick else 2048  # blocks of 2 MiB: 4 GiB, 16x the pool; 8 timed rounds
    restarts = (10_000,) if args.quick else (100_000, 1_000_000)
    needed = 4 * count * BLOCK + max(restarts) * 4096 + (1 << 30)
    free = shutil.disk_usage(args.dir).free
    if free < needed:
        sys.exit(f"fs_tier bench: {args.dir} has {free / GB:.1f} GB free, needs {needed / GB:.1f} GB")
    directory = Path(tempfile.mkdtemp(prefix="kvt-fsbench-", dir=args.dir))
    try:
        data = aligned_empty(32 * BLOCK).reshape(32, BLOCK)  # O_DIRECT writes of the baselines need aligned bytes
        data[:] = contents(chain_hashes("fs-bench-data", 32), BLOCK)
        result: dict = {"block_bytes": BLOCK, "data_bytes": count * BLOCK, "io_threads": args.io_threads}
        if args.full_tier_only:
            result = {"block_bytes": BLOCK, "io_threads": args.io_threads}
            result |= full_tier_demotion(directory, data, max(1, count // BURST // 2), args.io_threads)
            command = "python bench/fs_tier.py " + " ".join(sys.argv[1:])
            print(write_result("fs_tier_full", result, command.strip()).read_text())
            return
        result |= baseline(directory, data, count * BLOCK, args.io_threads)
        result |= demotion(directory, data, count, args.io_threads)
        result |= full_tier_demotion(directory, data, max(1, count // BURST // 2), args.io_threads)
        result |= write_through(directory, data, count, args.io_threads)
        result |= streaming(directory, data, count, args.io_threads, clients=2)
        write_base = max(result["dd_write_GBps"], result["parallel_write_GBps"])
        result["store_and_demote_ratio"] = result["store_and_demote_GBps"] / write_base
        result["restart"] = [restart(directory, n) for n in restarts]
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    command = "python bench/fs_tier.py " + " ".join(sys.argv[1:])
    print(write_result("fs_tier" if not args.quick else "fs_tier_quick", result, command.strip()).read_text())


if __name__ == "__main__":
    main()
