from dataclasses import dataclass

from kvtierd.eviction import ARCPolicy, LRUPolicy


@dataclass(eq=False)
class Item:
    key: str


def test_lru_evicts_least_recently_used_and_skips_removed():
    lru = LRUPolicy()
    a, b, c = Item("a"), Item("b"), Item("c")
    for item in (a, b, c):
        lru.insert(item)
    lru.access(a)
    lru.remove(b)  # pinned: never a victim
    assert lru.pop_victim() is c
    assert lru.pop_victim() is a
    assert lru.pop_victim() is None
    lru.restore(b)
    assert lru.pop_victim() is b


def test_arc_keeps_frequently_used_blocks_through_a_scan():
    arc, lru = ARCPolicy(), LRUPolicy()
    capacity = 50

    def run(policy):
        resident: dict[str, Item] = {}

        def touch(key: str) -> None:
            if key in resident:
                policy.access(resident[key])
                return
            if len(resident) >= capacity:
                victim = policy.pop_victim()
                del resident[victim.key]
            item = Item(key)
            resident[key] = item
            policy.insert(item)

        hot = [f"hot{i}" for i in range(20)]
        for _ in range(5):
            for key in hot:
                touch(key)
        for i in range(200):  # one-off scan
            touch(f"scan{i}")
            if i % 10 == 0:
                for key in hot[:5]:
                    touch(key)
        return sum(key in resident for key in hot)

    assert run(arc) > run(lru)
    assert run(ARCPolicy()) >= 15


def test_arc_ghost_hit_adapts_target():
    arc = ARCPolicy()
    items = [Item(str(i)) for i in range(4)]
    for item in items:
        arc.insert(item)
    victim = arc.pop_victim()
    assert victim is items[0]
    arc.insert(Item(victim.key))  # came back: a ghost hit in B1 grows T1's target
    assert arc.p > 0
    assert len(arc) == 4
