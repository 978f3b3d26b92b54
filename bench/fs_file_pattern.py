"""What one fsync'd file per block costs on this disk, step by step toward the tier's writer, against dd.

The filesystem tier writes each 2 MiB block as its own file (a 4 KiB header, the bytes, fsync,
rename). This benchmark runs, in alternating rounds (this disk's speed drifts by tens of percent
within minutes), bursts of BURST blocks from 16 threads with O_DIRECT, each from a synced filesystem:
  dd          one file, BURST writes of 2 MiB, one fsync (the baseline of bench/fs_tier.py)
  files       one file per block, 2 MiB each, fsync'd
  header      the same with files of 2 MiB + 4 KiB (the tier's size)
  rename      the same, written under a temporary name and renamed
  fanout      the same, spread over 16 directories (the tier's fan-out)
  xxh3        the same, with the xxh3 of the bytes taken on the thread first (kvtierd.xxh3)
  tier        kvtierd's own fs_format.write_block_file (header, xxh3, O_DIRECT, fsync, rename), 16 dirs
  recycled    as fanout, but each file is an older block's (written and synced before the round, as
              a full tier's evicted block would be): renamed to the temporary name, overwritten in
              place, fsync'd, renamed (what a full tier does with the files of the blocks it evicts)
A ratio is the paired dd's seconds over the variant's, median over rounds. Writes
bench/results/fs_file_pattern.json. Usage: python bench/fs_file_pattern.py [--dir DIR] [--rounds N]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import secrets
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

from common import write_result  # isort: skip
from fs_tier import BLOCK, BURST, GB, timed_write  # isort: skip

from kvtierd import fs_format  # noqa: E402
from kvtierd.xxh3 import xxh3_64  # noqa: E402

THREADS = 16


def write_file(root: Path, i: int, *, buffers: list, size: int, temporary: bool, fanout: bool, checksum: bool) -> None:
    data = memoryview(buffers[i % len(buffers)])[:size]
    directory = root / f"{i % 16:x}" if fanout else root
    final = directory / f"{i}.blk"
    path = final.with_name(f"{final.name}.{secrets.token_hex(6)}.tmp") if temporary else final
    if checksum:
        xxh3_64([data[fs_format.ALIGN :]])
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_DIRECT, 0o600)
    try:
        os.pwritev(fd, [data], 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    if temporary:
        os.rename(path, final)


def recycled_file(root: Path, i: int, *, buffers: list) -> None:
    directory = root / f"{i % 16:x}"
    final = directory / f"{i}.blk"
    temporary = final.with_name(f"{final.name}.{secrets.token_hex(6)}.tmp")
    os.rename(directory / f"old-{i}.blk", temporary)
    fd = os.open(temporary, os.O_WRONLY | os.O_DIRECT)
    try:
        os.pwritev(fd, [memoryview(buffers[i % len(buffers)])[: BLOCK + fs_format.ALIGN]], 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.rename(temporary, final)


def recycled_burst(buffers: list, root: Path) -> float:
    """A burst of recycled_file, over BURST older files written and synced first (not timed)."""
    for i in range(BURST):
        fd = os.open(root / f"{i % 16:x}" / f"old-{i}.blk", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
        try:
            os.pwritev(fd, [memoryview(buffers[0])[: BLOCK + fs_format.ALIGN]], 0)
        finally:
            os.close(fd)
    os.sync()
    return burst(partial(recycled_file, buffers=buffers), root)


def tier_file(root: Path, i: int, *, buffers: list) -> None:
    block_hash = hashlib.sha256(str(i).encode()).digest()
    path = root / block_hash.hex()[0] / f"{block_hash.hex()}{fs_format.SUFFIX}"
    data = [memoryview(buffers[i % len(buffers)])[:BLOCK]]
    fs_format.write_block_file(path, "0" * 64, block_hash, BLOCK, 1, time.time(), data, direct=True)


def burst(write, root: Path) -> float:
    with ThreadPoolExecutor(THREADS) as pool:
        started = time.perf_counter()
        list(pool.map(partial(write, root), range(BURST)))
        return time.perf_counter() - started


def dd(buffers: list, root: Path) -> float:
    """fs_tier's dd burst: one file, BURST writes of 2 MiB from one thread, one fsync."""
    return timed_write(root / "dd.bin", [(i * BLOCK, memoryview(buffers[0])[:BLOCK]) for i in range(BURST)], 1)


def ratios(dd_seconds: list[float], seconds: list[float]) -> list[float]:
    return [d / x for d, x in zip(dd_seconds, seconds, strict=True)]


def empty(root: Path) -> None:
    shutil.rmtree(root)
    root.mkdir()
    for digit in range(16):
        (root / f"{digit:x}").mkdir()
    os.sync()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, default=Path("/tmp"), help="a directory on the disk to measure")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    buffers = [fs_format.aligned_empty(BLOCK + fs_format.ALIGN) for _ in range(THREADS)]
    for i, buffer in enumerate(buffers):
        buffer[:] = i + 1

    def files(size: int, temporary: bool = False, fanout: bool = False, checksum: bool = False):
        write = partial(write_file, buffers=buffers, size=size, temporary=temporary, fanout=fanout, checksum=checksum)
        return partial(burst, write)

    variants = {
        "dd": partial(dd, buffers),
        "files": files(BLOCK),
        "header": files(BLOCK + fs_format.ALIGN),
        "rename": files(BLOCK + fs_format.ALIGN, temporary=True),
        "fanout": files(BLOCK + fs_format.ALIGN, temporary=True, fanout=True),
        "xxh3": files(BLOCK + fs_format.ALIGN, temporary=True, fanout=True, checksum=True),
        "tier": partial(burst, partial(tier_file, buffers=buffers)),
        "recycled": partial(recycled_burst, buffers),
    }
    seconds: dict[str, list[float]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory(dir=args.dir, prefix="kvtier-fs-pattern-") as scratch:
        root = Path(scratch) / "files"
        root.mkdir()
        for round_index in range(args.rounds):
            for name, run in variants.items():
                empty(root)
                seconds[name].append(run(root))
            print(round_index, {name: round(BURST * BLOCK / s[-1] / GB, 3) for name, s in seconds.items()}, flush=True)
        empty(root)
    result = {
        "dir": str(args.dir),
        "rounds": args.rounds,
        "burst_blocks": BURST,
        "block_bytes": BLOCK,
        "threads": THREADS,
        "GBps": {name: statistics.median(BURST * BLOCK / x / GB for x in s) for name, s in seconds.items()},
        "ratio_to_paired_dd": {name: statistics.median(ratios(seconds["dd"], s)) for name, s in seconds.items()},
        "ratio_range": {name: [min(ratios(seconds["dd"], s)), max(ratios(seconds["dd"], s))] for name, s in seconds.items()},
    }
    command = "python bench/fs_file_pattern.py" + (f" --rounds {args.rounds}" if args.rounds != 6 else "")
    path = write_result("fs_file_pattern", result, command)
    print(result["ratio_to_paired_dd"])
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
