"""A model directory's fingerprint, for the namespace: the same files give the same digest whenever
they were copied (engines that each downloaded the model under the same path share blocks, and so
does an engine restarted with a fresh copy), while other weights, even of the same names and sizes,
almost surely give another.

Only files that make the model's KV values count (MODEL_SUFFIXES: weights, JSON configs and
indexes, model code), not hidden files, READMEs or licences, which one download has and another
not. Files up to WHOLE_FILE_BYTES are read whole; larger ones (weights) by a safetensors header
whole (every tensor's name, dtype, shape and offset) and SAMPLES pieces of SAMPLE_BYTES spread
evenly from their first byte to their last, so a model of hundreds of GB costs a few reads a file,
on FINGERPRINT_THREADS threads (a network filesystem's latency is paid once per thread, not per
read). A changed stretch of a file longer than 1/(SAMPLES - 1) of it is always seen; weights changed
only where the pieces miss (one tensor of many, say) keep the digest: give such a model a
`revision` or a `namespace_extra` of its own. A file that cannot be read counts by its name (and
size, once opened) and the error.
"""

from __future__ import annotations

import hashlib
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

MODEL_SUFFIXES = frozenset({".safetensors", ".bin", ".pt", ".pth", ".gguf", ".tensors", ".json", ".py"})
WHOLE_FILE_BYTES = 1 << 20
SAMPLES = 64
SAMPLE_BYTES = 4096
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on a header
FINGERPRINT_THREADS = 16


def files_fingerprint(path: Path) -> str:
    """A digest of the names, sizes and contents (whole or sampled) of a directory's model files, or
    of one file (a GGUF model is one)."""
    if path.is_file():
        files = [path]
    else:
        files = sorted(p for p in path.iterdir() if p.suffix in MODEL_SUFFIXES and not p.name.startswith("."))
    with ThreadPoolExecutor(FINGERPRINT_THREADS, thread_name_prefix="kvtier-fingerprint") as pool:
        return hashlib.sha256(b"".join(pool.map(_file_digest, files))).hexdigest()


def _file_digest(path: Path) -> bytes:
    """The digest of a regular file's name, size and contents (whole or sampled); nothing for
    anything else (a directory, a dangling symlink)."""
    digest = hashlib.sha256(os.fsencode(path.name) + b"\0")
    try:
        if not path.is_file():
            return b""
        with path.open("rb") as file:
            size = os.fstat(file.fileno()).st_size
            digest.update(f"{size}\0".encode())
            for offset, length in _pieces(file.fileno(), size, path.suffix == ".safetensors"):
                digest.update(os.pread(file.fileno(), length, offset))
    except OSError as exc:
        digest.update(f"unreadable\0{type(exc).__name__}".encode())  # (its name, and its size if it was opened)
    return digest.digest()


def _pieces(fd: int, size: int, safetensors: bool) -> list[tuple[int, int]]:
    """(offset, length) of what to read of a file of `size` bytes."""
    if size <= WHOLE_FILE_BYTES:
        return [(0, size)]
    pieces = []
    if safetensors:  # an 8-byte little-endian length, then the JSON header
        (header,) = struct.unpack("<Q", os.pread(fd, 8, 0).ljust(8, b"\0"))
        pieces.append((0, 8 + min(header, MAX_HEADER_BYTES, size - 8)))
    last = size - SAMPLE_BYTES
    return pieces + [(last * i // (SAMPLES - 1), SAMPLE_BYTES) for i in range(SAMPLES)]
