"""The fs tier's index file, so a restart need not list every block file.

`<root>/index.kvi` holds, for each namespace and each of its fan-out directories, the directory's mtime
and the hashes of the blocks it held (b"KVTI", an xxh3-64 of the rest, then msgpack). The tier writes it
every --fs-index-interval while its index changes, and on a clean shutdown. At start a directory whose
mtime still equals the recorded one takes its hashes from the file; any other is listed as before.

Why an equal mtime means the same names: any create, rename or unlink in a directory sets its mtime to
the current time. The mtimes are taken BEFORE the hashes are copied from the index, so a change after
the stat leaves a newer mtime. A directory modified less than RACY_SECONDS before the stat is not
recorded (a filesystem's coarse timestamps, or the clock's coarse tick, could give a change just
after the stat the same mtime), and neither
is one with a block write in flight (it may hold a temporary file). The tier fsyncs the directories
renamed into after the hashes are copied and before the file is written. So a recorded directory
held exactly the recorded names when the hashes were copied, all of them durable; a crash that undoes
later changes also restores an older mtime. A file that is gone or bad though named in the index
file is caught like any other: every read verifies.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import msgpack
import xxhash

log = logging.getLogger("kvtierd.fs")

INDEX_FILE = "index.kvi"
RACY_SECONDS = 2.0  # beyond the coarsest mtimes in use: 1 s (ext3, ext4 with 128-byte inodes, some NFS), 2 s (FAT)
_MAGIC = b"KVTI"
_VERSION = 1

Mtimes = dict[str, dict[str, int]]  # namespace digest -> fan-out directory name -> st_mtime_ns
Known = dict[str, tuple[int, bytes]]  # fan-out directory name -> (st_mtime_ns, concatenated hashes)


def directory_mtimes(root: Path, digests: list[str], fanout: list[str]) -> Mtimes:
    """The mtimes of the namespaces' fan-out directories not modified in the last RACY_SECONDS."""
    settled = time.time_ns() - int(RACY_SECONDS * 1e9)
    mtimes: Mtimes = {}
    for digest in digests:
        found = {}
        for name in fanout:
            try:
                mtime = os.stat(root / digest / name).st_mtime_ns
            except FileNotFoundError:
                continue
            if mtime < settled:
                found[name] = mtime
        mtimes[digest] = found
    return mtimes


def write_index_file(root: Path, mtimes: Mtimes, hashes: dict[str, list[bytes]], fanout_of: Callable[[bytes], str]) -> None:
    """Record the hashes of the directories in `mtimes` (written atomically: temporary, fsync, rename)."""
    namespaces = {}
    for digest, recorded in mtimes.items():
        by_directory: dict[str, list[bytes]] = defaultdict(list)
        for block_hash in hashes.get(digest, ()):
            by_directory[fanout_of(block_hash)].append(block_hash)
        namespaces[digest] = {name: [mtime, b"".join(by_directory[name])] for name, mtime in recorded.items()}
    payload = msgpack.packb({"v": _VERSION, "ns": namespaces})
    temporary = root / f"{INDEX_FILE}.{secrets.token_hex(6)}.tmp"
    try:
        with open(temporary, "wb") as f:
            f.write(_MAGIC + xxhash.xxh3_64_digest(payload) + payload)
            f.flush()
            os.fsync(f.fileno())
        os.rename(temporary, root / INDEX_FILE)
    finally:
        temporary.unlink(missing_ok=True)
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_index_file(root: Path) -> dict[str, Known]:
    """What the index file records per namespace; empty when there is none or it is not intact."""
    path = root / INDEX_FILE
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return {}
    except OSError as exc:  # a failing disk: list every directory instead
        log.warning("cannot read the fs index file; every directory is listed", extra={"path": str(path), "reason": str(exc)})
        return {}
    head = len(_MAGIC) + 8
    try:
        if data[: len(_MAGIC)] != _MAGIC or xxhash.xxh3_64_digest(data[head:]) != data[len(_MAGIC) : head]:
            raise ValueError("bad magic or checksum")
        fields = msgpack.unpackb(data[head:])
        if fields["v"] != _VERSION:
            raise ValueError(f"version {fields['v']}")
        return {digest: {name: (mtime, blob) for name, (mtime, blob) in dirs.items()} for digest, dirs in fields["ns"].items()}
    except (ValueError, KeyError, TypeError, msgpack.UnpackException) as exc:
        log.warning("ignoring the fs index file; every directory is listed", extra={"path": str(path), "reason": str(exc)})
        return {}
