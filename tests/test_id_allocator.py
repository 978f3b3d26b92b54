import numpy as np
import pytest

from kvtierd.id_allocator import IdAllocator


def test_allocates_until_full_then_refuses():
    alloc = IdAllocator(10)
    first = alloc.allocate(4)
    assert first.tolist() == [0, 1, 2, 3]
    second = alloc.allocate(6)
    assert sorted(np.concatenate([first, second]).tolist()) == list(range(10))
    assert alloc.allocate(1) is None
    assert alloc.free == 0 and alloc.used == 10


def test_release_returns_pages_and_detects_double_free():
    alloc = IdAllocator(8)
    pages = alloc.allocate(5)
    alloc.release(pages[:2])
    assert alloc.free == 5
    with pytest.raises(RuntimeError):
        alloc.release(pages[:1])
    with pytest.raises(RuntimeError):
        alloc.release(np.array([7, 7], dtype=np.uint32))
    again = alloc.allocate(5)
    assert set(again.tolist()) == {0, 1, 5, 6, 7}


def test_random_churn_keeps_every_page_owned_once():
    rng = np.random.default_rng(0)
    alloc = IdAllocator(1000)
    held: list[np.ndarray] = []
    for _ in range(2000):
        if held and rng.random() < 0.5:
            alloc.release(held.pop(rng.integers(len(held))))
        else:
            pages = alloc.allocate(int(rng.integers(1, 40)))
            if pages is not None:
                held.append(pages)
        owned = np.concatenate(held) if held else np.empty(0, np.uint32)
        assert np.unique(owned).size == owned.size == alloc.used
