from kvtierd.eviction import ARCPolicy, LRUPolicy


def test_lru_evicts_least_recently_used_and_skips_removed():
    lru = LRUPolicy()
    lru.insert_many([1, 2, 3], ["a", "b", "c"])
    lru.access_many([1])
    lru.remove_many([2], forget=False)  # pinned: never a victim
    assert lru.pop_victim() == 3
    assert lru.pop_victim() == 1
    assert lru.pop_victim() is None
    lru.restore_many([2])
    assert lru.pop_victim() == 2


def run_workload(policy, capacity: int = 50) -> int:
    """Hot keys reused, then a long one-off scan with a few hot touches: how many hot keys survive."""
    resident: dict[str, int] = {}
    key_of: dict[int, str] = {}
    next_slot = iter(range(1_000_000))

    def touch(key: str) -> None:
        if key in resident:
            policy.access_many([resident[key]])
            return
        if len(resident) >= capacity:
            del resident[key_of.pop(policy.pop_victim())]
        slot = next(next_slot)
        resident[key] = slot
        key_of[slot] = key
        policy.insert_many([slot], [key])

    hot = [f"hot{i}" for i in range(20)]
    for _ in range(5):
        for key in hot:
            touch(key)
    for i in range(200):
        touch(f"scan{i}")
        if i % 10 == 0:
            for key in hot[:5]:
                touch(key)
    return sum(key in resident for key in hot)


def test_arc_keeps_frequently_used_blocks_through_a_scan():
    assert run_workload(ARCPolicy()) > run_workload(LRUPolicy())
    assert run_workload(ARCPolicy()) >= 15


def test_arc_ghost_hit_adapts_target():
    arc = ARCPolicy()
    arc.insert_many([0, 1, 2, 3], ["k0", "k1", "k2", "k3"])
    assert arc.pop_victim() == 0
    arc.insert_many([9], ["k0"])  # came back: a ghost hit in B1 grows T1's target and lands in T2
    assert arc.p > 0
    assert len(arc) == 4
    arc.remove_many([9], forget=True)
    assert len(arc) == 3


def test_arc_pinned_blocks_come_back_as_recent():
    arc = ARCPolicy()
    arc.insert_many([0, 1], ["a", "b"])
    arc.remove_many([0], forget=False)
    assert arc.pop_victim() == 1
    arc.restore_many([0])
    assert arc.pop_victim() == 0


def test_a_refresh_keeps_a_block_longer_without_counting_a_use():
    """FsIndex.demoted: a block's file became its only copy. LRU: like a use. ARC: to the newest end of
    its own list; a block seen once stays among those seen once (a use would move it to T2)."""
    lru = LRUPolicy()
    lru.insert_many([1, 2], ["a", "b"])
    lru.refresh_many([1])
    assert lru.pop_victim() == 2
    arc = ARCPolicy()
    arc.insert_many([1, 2, 3], ["a", "b", "c"])
    arc.access_many([3])  # C seen twice: in T2
    arc.refresh_many([1])
    assert list(arc._t1) == [2, 1] and list(arc._t2) == [3]
    assert [arc.pop_victim() for _ in range(3)] == [2, 1, 3]


def test_an_undone_eviction_puts_the_victim_back_as_the_next_one():
    """A victim whose eviction is undone (the fs tier's write it made room for failed) is evicted
    next again, in its old order, without counting as a use: ARC neither adapts to it as a ghost hit
    nor promotes it to the frequent list."""
    lru = LRUPolicy()
    lru.insert_many([1, 2, 3], ["a", "b", "c"])
    first, second = lru.pop_victim(), lru.pop_victim()
    lru.unevict(second, "b")
    lru.unevict(first, "a")
    assert [lru.pop_victim() for _ in range(3)] == [1, 2, 3]

    arc = ARCPolicy()
    arc.insert_many([1, 2, 3], ["a", "b", "c"])
    arc.access_many([3])  # C is used twice: the frequent list
    assert arc.pop_victim() == 1
    arc.unevict(1, "a")
    assert arc.p == 0.0 and 1 in arc._t1 and "a" not in arc._b1
    assert arc.pop_victim() == 1
    arc.insert_many([4], ["a"])  # A comes back as a new block: its ghost was kept by this eviction
    assert arc.p > 0.0 and 4 in arc._t2
