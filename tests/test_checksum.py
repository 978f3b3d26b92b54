import numpy as np
import pytest

from kvtier.checksum import block_checksums, chunk_sums, combine, decode, encode


def test_chunked_checksums_equal_whole_block_checksums():
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (5, 4096 + 24), dtype=np.uint8)
    whole = block_checksums(blocks)
    parts = combine([chunk_sums(blocks[:, :1024]), chunk_sums(blocks[:, 1024:4000], 1024), chunk_sums(blocks[:, 4000:], 4000)])
    assert np.array_equal(whole, parts)
    assert np.array_equal(decode(encode(whole)), whole)


@pytest.mark.parametrize("size", [8, 1001, 65536])
def test_any_single_bit_flip_changes_the_checksum(size):
    rng = np.random.default_rng(size)
    block = rng.integers(0, 256, (1, size), dtype=np.uint8)
    before = block_checksums(block)[0]
    for position in rng.integers(0, size, 50):
        flipped = block.copy()
        flipped[0, position] ^= 1 << int(rng.integers(8))
        assert block_checksums(flipped)[0] != before


def test_position_matters_and_zero_is_never_returned():
    a = np.zeros((1, 16), np.uint8)
    a[0, 0] = 1
    b = np.zeros((1, 16), np.uint8)
    b[0, 8] = 1
    assert block_checksums(a)[0] != block_checksums(b)[0]
    assert block_checksums(np.zeros((2, 64), np.uint8)).tolist() == [1, 1]


def test_chunks_must_be_word_aligned():
    with pytest.raises(ValueError):
        chunk_sums(np.zeros((1, 8), np.uint8), 3)
