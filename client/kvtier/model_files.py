"""A model directory's fingerprint, for the namespace: the same files give the same digest wherever
and whenever they were copied (engines that each downloaded the model share blocks, and so does an
engine restarted with a fresh copy), while other weights, even of the same names and sizes, almost
surely give another.

Files up to WHOLE_FILE_BYTES (configs, tokenizers, weight indexes) are read whole; larger ones
(weights) by SAMPLES pieces of SAMPLE_BYTES spread evenly from their first byte (a safetensors
header: every tensor's name, shape and offset) to their last, so a model of hundreds of GB costs a
few reads a file. Weights changed in a part the samples miss (one layer of 32 changed, say) can
share a digest: give such a model a `revision` or a `namespace_extra` of its own.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

WHOLE_FILE_BYTES = 1 << 20
SAMPLES = 64
SAMPLE_BYTES = 4096


def files_fingerprint(directory: Path) -> str:
    """A digest of the names, sizes and contents (whole or sampled) of a directory's files."""
    digest = hashlib.sha256()
    for path in sorted(p for p in directory.iterdir() if p.is_file()):
        with path.open("rb") as file:
            size = os.fstat(file.fileno()).st_size
            digest.update(f"{path.name}\0{size}\n".encode())
            for offset in _sample_offsets(size):
                digest.update(os.pread(file.fileno(), min(SAMPLE_BYTES, size), offset))
    return digest.hexdigest()


def _sample_offsets(size: int) -> list[int]:
    if size <= WHOLE_FILE_BYTES:
        return list(range(0, size, SAMPLE_BYTES))
    last = size - SAMPLE_BYTES
    return [last * i // (SAMPLES - 1) for i in range(SAMPLES)]
