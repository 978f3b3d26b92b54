"""The kvtier block checksum.

A block's checksum is the sum, modulo 2**64, of its little-endian 64-bit words (the last one
zero-padded) each multiplied by a fixed pseudo-random odd weight for its position. It is linear, so a
block laid out in separate chunks (one per layer, say) is checksummed chunk by chunk with vectorised
numpy work and the parts added up; a change to any single word changes it, and two unrelated blocks
share it with probability about 2**-64. 0 means "no checksum", so a computed 0 is stored as 1.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_ONE = np.uint64(1)


@lru_cache(maxsize=64)
def _weights(first_word: int, count: int) -> np.ndarray:
    """splitmix64 of the word positions, made odd."""
    with np.errstate(over="ignore"):
        z = (np.arange(first_word, first_word + count, dtype=np.uint64) + np.uint64(1)) * _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    z.setflags(write=False)
    return z | np.uint64(1)


def chunk_sums(chunk: np.ndarray, byte_offset: int = 0) -> np.ndarray:
    """Partial checksums of rows `chunk` [n, chunk_bytes] (uint8) that start at `byte_offset` of their
    blocks; `byte_offset` must be a multiple of 8. Add the parts of a block with `combine`."""
    if byte_offset % 8:
        raise ValueError("chunks must start at a multiple of 8 bytes")
    n, size = chunk.shape
    full = size // 8 * 8
    words = np.ascontiguousarray(chunk[:, :full]).view("<u8")
    with np.errstate(over="ignore"):
        sums = np.einsum("ij,j->i", words, _weights(byte_offset // 8, full // 8), dtype=np.uint64)
        if full < size:
            tail = np.zeros((n, 8), dtype=np.uint8)
            tail[:, : size - full] = chunk[:, full:]
            sums += tail.view("<u8")[:, 0] * _weights((byte_offset + full) // 8, 1)[0]
    return sums


def combine(parts) -> np.ndarray:
    """Blocks' checksums from their parts: parts[k][i] is block i's k-th part (a list of arrays, or a
    2-D array). Arrays of integers add up modulo 2**64 without a warning."""
    total = np.add.reduce(parts, axis=0, dtype=np.uint64) if len(parts) else np.zeros(0, np.uint64)
    return np.maximum(total, _ONE, out=total)  # (0 stands for "no checksum": a computed 0 becomes 1)


def block_checksums(blocks: np.ndarray) -> np.ndarray:
    """Checksums of whole blocks [n, block_bytes] (uint8)."""
    return combine([chunk_sums(blocks)])


def mismatched(actual: np.ndarray, expected: np.ndarray) -> np.ndarray:
    """Per block: the stored checksum is known (not 0) and differs from the bytes' checksum."""
    return (expected != 0) & (actual != expected)


def encode(checksums: np.ndarray) -> bytes:
    return np.asarray(checksums, dtype="<u8").tobytes()


def decode(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<u8")
