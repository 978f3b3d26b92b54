"""On-disk format of the filesystem tier: one file per block, written atomically, verified on every read.

Layout under --fs-path (every component is our own hex, so no client string can steer a path):

    <digest>/namespace.pb           the NamespaceSpec, so a restarted daemon knows the namespace
    <digest>/<h>/<hash hex>.kvb     one block; h is the hash's first hex digit (16 fan-out dirs)

Few fan-out directories: ext4 places a file's data near its directory, so files spread over 256
directories were written to scattered places on the disk, and a burst of them took about a third
longer than with 16 (alternating rounds on a virtio disk). 16 still keeps a million blocks to 62,500
names per directory.

A block file is b"KVTB", a little-endian uint32 header length, the msgpack header (format version,
namespace digest, hash, length, xxh3-64 of the bytes, kvtier checksum, created time, data offset),
zero padding up to the data offset, then the block's raw bytes. The data offset is 4096 for files
written with O_DIRECT (so data reads can be direct too), else right after the header.

A block is written to a `.tmp` name, fsync'd and renamed into place (write_block_file): a crash at
any moment leaves no file (maybe a stray .tmp, removed at the next start) or the complete block.
The `.tmp` may be an evicted block's file, renamed to it (the rename made durable by fsyncing the
old name's directory, so a power cut cannot bring the old name back over new bytes) and overwritten
in place: its space is already allocated, which a virtual disk writes much faster than a new file's
(bench/fs_file_pattern: 1.5x dd's new file where a new file per block reached 0.85-0.9). The
directory is not fsync'd per block: a power cut may undo a recent rename, which only loses that block.
The tier fsyncs the directories that gained or lost names before it writes an index file
(fs_snapshot). Reads check the header and the xxh3 of the bytes; anything else raises BadBlock.

Everything here is blocking file I/O, called on the tier's thread pool, never on the event loop.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import secrets
import shutil
import stat
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import msgpack
import numpy as np

from kvtier.v1 import kvtier_pb2 as pb
from kvtierd.fs_snapshot import Known
from kvtierd.namespace import namespace_digest
from kvtierd.xxh3 import xxh3_64

log = logging.getLogger("kvtierd.fs")

MAGIC = b"KVTB"
FORMAT_VERSION = 1
ALIGN = 4096  # O_DIRECT alignment of buffers, offsets and lengths
SUFFIX = ".kvb"
TMP_SUFFIX = ".tmp"
SPEC_FILE = "namespace.pb"
_PREFIX = struct.Struct("<4sI")
_COVERED = ("v", "ns", "hash", "len", "xxh3", "sum", "created", "direct")  # the header fields "hx" covers
_IOV_MAX = 1024
FANOUT = [f"{i:x}" for i in range(16)]
_OLD_FANOUT = re.compile(r"[0-9a-f]{2}")  # the 256 fan-out directories of the first layout


class BadBlock(Exception):
    """The file is not an intact copy of the block: torn, truncated, corrupt or for another block."""


@dataclass(frozen=True)
class Header:
    namespace: str
    hash: bytes
    length: int
    xxh3: int
    checksum: int  # the kvtier checksum given at commit (0: none), handed to loaders after promotion
    created_at: float
    data_offset: int


def align_up(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


def charged_bytes(block_bytes: int) -> int:
    """Disk bytes a block is counted for against --fs-size: its data plus one 4 KiB header, rounded up."""
    return ALIGN + align_up(block_bytes)


def aligned_empty(size: int) -> np.ndarray:
    """An uninitialised uint8 buffer whose address is a multiple of ALIGN (for O_DIRECT)."""
    raw = np.empty(size + ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % ALIGN
    return raw[start : start + size]


def namespace_dir(root: Path, digest: str) -> Path:
    return root / digest


def block_path(root: Path, digest: str, block_hash: bytes) -> Path:
    return root / digest / fanout_of(block_hash) / (block_hash.hex() + SUFFIX)


def fanout_of(block_hash: bytes) -> str:
    """The fan-out directory a block's file is in."""
    return FANOUT[block_hash[0] >> 4]


def fsync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _trim(segments: Sequence[memoryview], total: int) -> list[memoryview]:
    """The leading `total` bytes of `segments`, as a list of views."""
    out, left = [], total
    for segment in segments:
        if left <= 0:
            break
        take = min(len(segment), left)
        out.append(segment[:take])
        left -= take
    if left > 0:
        raise ValueError(f"segments hold {total - left} bytes, {total} needed")
    return out


def _pwritev_all(fd: int, segments: list[memoryview], offset: int) -> None:
    while segments:
        chunk = segments[:_IOV_MAX]
        written = os.pwritev(fd, chunk, offset)
        offset += written
        for i, segment in enumerate(chunk):  # drop what was written; keep the rest of a partly written one
            if written < len(segment):
                segments = [segment[written:], *chunk[i + 1 :], *segments[len(chunk) :]]
                break
            written -= len(segment)
        else:
            segments = segments[len(chunk) :]


def _preadv_all(fd: int, segments: list[memoryview], offset: int) -> int:
    """Fill `segments` from `offset`; returns the bytes read (fewer only at end of file)."""
    total = 0
    for start in range(0, len(segments), _IOV_MAX):
        chunk = segments[start : start + _IOV_MAX]
        wanted = sum(map(len, chunk))
        got = os.preadv(fd, chunk, offset + total)
        total += got
        if got < wanted:
            break
    return total


def write_spec(root: Path, spec: pb.NamespaceSpec) -> None:
    """Create a namespace's directories and its spec file (idempotent)."""
    directory = namespace_dir(root, namespace_digest(spec))
    if (directory / SPEC_FILE).exists():
        return
    for name in FANOUT:
        (directory / name).mkdir(parents=True, exist_ok=True)
    temporary = directory / f"{SPEC_FILE}.{secrets.token_hex(6)}{TMP_SUFFIX}"
    with open(temporary, "wb") as f:
        f.write(spec.SerializeToString())
        f.flush()
        os.fsync(f.fileno())
    os.rename(temporary, directory / SPEC_FILE)
    fsync_directory(directory)
    fsync_directory(root)


def read_spec(directory: Path) -> pb.NamespaceSpec | None:
    """The namespace a directory holds, or None when its spec file is missing or does not match its name."""
    try:
        spec = pb.NamespaceSpec.FromString((directory / SPEC_FILE).read_bytes())
    except (OSError, ValueError):
        return None
    return spec if namespace_digest(spec) == directory.name else None


def probe_direct_io(root: Path) -> bool:
    """Whether the filesystem under `root` takes O_DIRECT writes and reads."""
    path = root / f".direct-probe{TMP_SUFFIX}"
    buffer = aligned_empty(ALIGN)
    buffer[:] = 0
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
        try:
            os.pwritev(fd, [memoryview(buffer)], 0)
            os.preadv(fd, [memoryview(buffer)], 0)
        finally:
            os.close(fd)
        return True
    except OSError:
        return False
    finally:
        with contextlib.suppress(OSError):  # a read-only filesystem refuses even a missing file's unlink
            path.unlink(missing_ok=True)


def write_block_file(
    path: Path,
    digest: str,
    block_hash: bytes,
    length: int,
    checksum: int,
    created_at: float,
    segments: Sequence[memoryview],
    direct: bool,
    durable: bool = True,
    reuse: Path | None = None,
) -> None:
    """Write a block's file: to a temporary name next to `path` (the file `reuse`, an evicted block's,
    renamed to it when it is still there, else a new file), fsync'd, then renamed to `path` (its
    directory is not fsync'd). `segments` hold its bytes (with O_DIRECT: at least align_up(length),
    from ALIGN-aligned addresses, every segment but the last a multiple of ALIGN long). `durable`
    False leaves out the fsync (to fill a tier quickly for a benchmark)."""
    data = _trim(segments, length)
    fields = {
        "v": FORMAT_VERSION,
        "ns": digest,
        "hash": block_hash,
        "len": length,
        "xxh3": xxh3_64(data),
        "sum": checksum,
        "created": created_at,
        "direct": direct,  # data at offset ALIGN
    }
    header = msgpack.packb({**fields, "hx": _header_checksum(fields)})
    head = _PREFIX.pack(MAGIC, len(header)) + header
    if direct:
        head_buffer = aligned_empty(ALIGN)
        head_buffer[:] = 0
        head_buffer[: len(head)] = np.frombuffer(head, dtype=np.uint8)
        iov = [memoryview(head_buffer), *_trim(segments, align_up(length))]
        size = ALIGN + length
    else:
        iov = [memoryview(head), *data]
        size = len(head) + length
    temporary = path.with_name(f"{path.name}.{secrets.token_hex(6)}{TMP_SUFFIX}")
    try:
        fd = _open_temporary(temporary, reuse, os.O_WRONLY | os.O_CLOEXEC | (os.O_DIRECT if direct else 0))
        try:
            _pwritev_all(fd, iov, 0)
            if os.fstat(fd).st_size != size:
                os.ftruncate(fd, size)  # drop the alignment padding, or a longer old block's tail
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):  # (the write's own error is the one to report)
            temporary.unlink(missing_ok=True)
        raise


def _open_temporary(temporary: Path, reuse: Path | None, flags: int) -> int:
    """Open `temporary` for writing: `reuse` renamed to it if given and still there, else created."""
    if reuse is not None:
        try:
            os.rename(reuse, temporary)
        except FileNotFoundError:
            pass  # removed meanwhile (by hand, or its namespace cleared): a new file
        else:
            fsync_directory(reuse.parent)  # the old name is gone for good before its bytes are overwritten
            fd = _open_regular(temporary, flags)
            if fd is not None:
                return fd
            _remove_any(temporary)  # not a file we can write over (a FIFO or directory put there by hand): a new one
    return os.open(temporary, flags | os.O_CREAT | os.O_EXCL, 0o600)


def _remove_any(path: Path) -> None:
    if stat.S_ISDIR(os.lstat(path).st_mode):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _open_regular(path: Path, flags: int) -> int | None:
    """`path` opened with `flags` when it is a regular file; None for anything else (opened without
    blocking: a FIFO would otherwise hold the opening thread until someone opened its other end; a
    symbolic link is not followed)."""
    try:
        fd = os.open(path, flags | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno in (errno.ENXIO, errno.EISDIR, errno.ENODEV, errno.EOPNOTSUPP, errno.ELOOP):  # (FIFO, dir, device, link)
            return None
        raise
    if stat.S_ISREG(os.fstat(fd).st_mode):
        return fd
    os.close(fd)
    return None


def read_block(path: Path, digest: str, block_hash: bytes, length: int, segments: Sequence[memoryview], direct: bool) -> Header:
    """Read a block into `segments` (at least align_up(length) bytes, laid out as for write_block_file) and
    verify it. Raises FileNotFoundError when the file is gone and BadBlock when it is not intact. With
    `direct`, header and bytes come in one O_DIRECT request (a file written with O_DIRECT has its bytes
    at ALIGN); a file whose bytes are elsewhere is read again from there."""
    fd = _open_regular(path, os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if direct else 0))
    if fd is None:
        raise BadBlock(f"{path}: not a regular file")
    try:
        if direct:
            head = aligned_empty(ALIGN)
            total = _preadv_all(fd, [memoryview(head), *_trim(segments, align_up(length))], 0)
            header = _parse_header(head[: min(total, ALIGN)].tobytes(), path)
            got = total - ALIGN
        else:
            header = _parse_header(os.pread(fd, ALIGN, 0), path)
        if (header.namespace, header.hash, header.length) != (digest, block_hash, length):
            raise BadBlock(f"{path}: header names another block")
        if not direct or header.data_offset != ALIGN:
            if direct:
                fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)
            got = _preadv_all(fd, _trim(segments, length), header.data_offset)
        if got < length:
            raise BadBlock(f"{path}: truncated")
    finally:
        os.close(fd)
    if xxh3_64(_trim(segments, length)) != header.xxh3:
        raise BadBlock(f"{path}: checksum mismatch")
    return header


def _header_checksum(fields: dict) -> int:
    """XXH3-64 of the header's fields, so that no byte read back goes unchecked: the bytes' own xxh3,
    and the kvtier checksum handed to every loader of the block, are in the header."""
    return xxh3_64([msgpack.packb([fields.get(name) for name in _COVERED])])


def _parse_header(head: bytes, path: Path) -> Header:
    """The header at the start of a block file (`head`: its first ALIGN bytes, or fewer if it is shorter)."""
    if len(head) < _PREFIX.size:
        raise BadBlock(f"{path}: truncated header")
    magic, size = _PREFIX.unpack_from(head)
    if magic != MAGIC or _PREFIX.size + size > len(head):
        raise BadBlock(f"{path}: not a block file")
    try:
        fields = msgpack.unpackb(head[_PREFIX.size : _PREFIX.size + size])
        if fields["v"] != FORMAT_VERSION:
            raise BadBlock(f"{path}: format version {fields['v']}, expected {FORMAT_VERSION}")
        if "hx" in fields and fields["hx"] != _header_checksum(fields):  # (files written before it have none)
            raise BadBlock(f"{path}: header checksum mismatch")
        offset = ALIGN if fields.get("direct") else _PREFIX.size + size
        return Header(
            namespace=fields["ns"],
            hash=fields["hash"],
            length=fields["len"],
            xxh3=fields["xxh3"],
            checksum=fields["sum"],
            created_at=fields["created"],
            data_offset=offset,
        )
    except (ValueError, KeyError, TypeError, msgpack.UnpackException) as exc:
        raise BadBlock(f"{path}: unreadable header: {exc}") from exc


@dataclass
class ScannedNamespace:
    spec: pb.NamespaceSpec
    hashes: list[bytes]
    strays: int  # .tmp files of interrupted writes, removed
    listed: int  # fan-out directories listed (the others were taken from the index file)


def scan_namespace(directory: Path, known: Known, progress=None) -> ScannedNamespace | None:
    """The blocks a namespace directory holds, from file names alone (headers are checked on first read);
    a fan-out directory whose mtime equals the one `known` from the index file is not listed."""
    strays = 0
    for stray in directory.glob(f"{SPEC_FILE}.*{TMP_SUFFIX}"):  # a spec write that was interrupted
        strays += remove_file(stray)
    spec = read_spec(directory)
    if spec is None:
        return None
    hashes: list[bytes] = []
    listed = 0
    size = spec.hash_bytes
    for old in (d for d in directory.iterdir() if d.is_dir() and _OLD_FANOUT.fullmatch(d.name)):
        shutil.rmtree(old, ignore_errors=True)  # files of the first layout, no longer found by their names
        strays += 1
    for name in FANOUT:
        recorded = known.get(name)
        try:
            if recorded is not None and len(recorded[1]) % size == 0 and os.stat(directory / name).st_mtime_ns == recorded[0]:
                blob = recorded[1]
                hashes.extend(blob[i : i + size] for i in range(0, len(blob), size))
                if progress is not None:
                    progress.update(1)
                continue
            entries = os.listdir(directory / name)
        except FileNotFoundError:
            continue
        listed += 1
        for entry in entries:
            if entry.endswith(SUFFIX) and entry.startswith(name) and len(entry) == 2 * size + len(SUFFIX):
                try:
                    hashes.append(bytes.fromhex(entry[: -len(SUFFIX)]))
                except ValueError:
                    continue
        for stray in (n for n in entries if n.endswith(TMP_SUFFIX)):
            strays += remove_file(directory / name / stray)
        if progress is not None:
            progress.update(1)
    return ScannedNamespace(spec, hashes, strays, listed)


def remove_namespace_dir(directory: Path) -> bool:
    """Remove the directory of a namespace that holds no block, its spec file first (a namespace is
    never left with its spec and without its fan-out directories, which `write_spec` would not make
    again); False, with a warning, when something in it stays (its next `write_spec` then makes the
    rest again)."""
    try:
        (directory / SPEC_FILE).unlink(missing_ok=True)
        for name in FANOUT:
            with contextlib.suppress(FileNotFoundError):
                (directory / name).rmdir()
        directory.rmdir()
    except OSError as exc:
        log.warning("cannot remove an empty fs tier namespace", extra={"path": str(directory), "reason": str(exc)})
        return False
    return True


def remove_file(path: Path) -> bool:
    """Unlink `path` if it is there; False, with a warning, when the filesystem refuses (read-only or
    failing: the tier goes on without it)."""
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("cannot remove an fs tier file", extra={"path": str(path), "reason": str(exc)})
        return False
    return True
