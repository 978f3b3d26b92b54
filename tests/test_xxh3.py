"""kvtierd.xxh3 gives python-xxhash's XXH3-64 for any split of the bytes, through libxxhash where the
system has it (so the filesystem tier's I/O threads hash without holding the GIL)."""

import ctypes.util

import numpy as np
import pytest
import xxhash

from kvtierd import xxh3


@pytest.mark.parametrize("size", [0, 1, 16, 240, 241, 4096, 2 << 20])
def test_same_value_as_python_xxhash_in_one_piece_and_in_several(size):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    expected = xxhash.xxh3_64_intdigest(data.tobytes())
    assert xxh3.xxh3_64([memoryview(data)]) == expected
    assert xxh3.xxh3_64([data.tobytes()]) == expected  # read-only buffers too
    cuts = sorted({0, size, size // 3, size // 2})
    pieces = [memoryview(data[a:b]) for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
    assert xxh3.xxh3_64(pieces) == expected
    assert xxh3.xxh3_64([]) == xxhash.xxh3_64_intdigest(b"")


def test_libxxhash_is_used_where_the_system_has_it():
    assert xxh3.releases_gil() == (ctypes.util.find_library("xxhash") is not None)
