import numpy as np
import pytest
from blocks import chain_hashes, spec

from kvtier.v1 import kvtier_pb2 as pb
from kvtierd.block_store import BlockStore
from kvtierd.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied, ResourceExhausted

PAGE = 4096


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def make_store(pages=64, **kwargs):
    clock = Clock()
    store = BlockStore(num_pages=pages, page_size=PAGE, clock=clock, lease_ttl=10.0, **kwargs)
    return store, clock


def store_blocks(store, ns, hashes, session="s1"):
    result = store.reserve(session, ns, hashes)
    if result.reservation is not None:
        store.commit(session, result.reservation.id)
    return result


def assert_accounting(store):
    usage = store.usage()
    assert usage.used_pages == usage.committed_pages + usage.reserved_pages + usage.orphan_pages
    pinned = [b.namespace.pages_per_block for b in store.block_at if b is not None and store.pins[b.slot] > 0]
    assert store._pinned_pages == sum(pinned)  # (what a reserve sees as not evictable)
    pages = [np.frombuffer(b.pages, "<u4") for b in store.block_at if b is not None]
    if pages:
        owned = np.concatenate(pages)
        assert np.unique(owned).size == owned.size


def test_uncommitted_blocks_are_invisible_until_commit():
    store, _ = make_store()
    ns = store.register(spec(block_bytes=2 * PAGE))
    hashes = chain_hashes("a", 4)
    result = store.reserve("s1", ns, hashes)
    assert result.statuses.tolist() == [pb.BLOCK_STATUS_RESERVED] * 4
    assert store.lookup("s2", ns, hashes, pin=False)[0] == 0
    assert store.reserve("s2", ns, hashes).statuses.tolist() == [pb.BLOCK_STATUS_IN_PROGRESS] * 4
    assert store.commit("s1", result.reservation.id) == 4
    assert store.lookup("s2", ns, hashes, pin=False)[0] == 4
    assert store.reserve("s2", ns, hashes).statuses.tolist() == [pb.BLOCK_STATUS_PRESENT] * 4
    assert_accounting(store)


def test_lookup_counts_the_leading_prefix_only():
    store, _ = make_store()
    ns = store.register(spec(block_bytes=PAGE))
    hashes = chain_hashes("p", 6)
    store_blocks(store, ns, hashes[:2] + hashes[3:])
    assert store.lookup("s", ns, hashes, pin=False)[0] == 2


def test_abort_and_expiry_free_reservations_and_leases():
    store, clock = make_store(pages=16)
    ns = store.register(spec(block_bytes=PAGE))
    first = store.reserve("s1", ns, chain_hashes("x", 8)).reservation
    store.abort("s1", first.id)
    assert store.pages.free == 16
    store_blocks(store, ns, chain_hashes("z", 4))
    _, lease = store.lookup("s1", ns, chain_hashes("z", 4), pin=True)
    second = store.reserve("s1", ns, chain_hashes("y", 8)).reservation
    clock.now = 9
    assert store.expire() == (0, 0)
    clock.now = 11
    assert store.expire() == (1, 1)
    assert store.pages.free == 16 - 4 and store.usage().pinned_blocks == 0  # the committed blocks stay
    with pytest.raises(FailedPrecondition, match="expired"):
        store.commit("s1", second.id)
    with pytest.raises(NotFound):
        store.release("s1", lease.id)
    assert store.lookup("s1", ns, chain_hashes("y", 8), pin=False)[0] == 0
    assert_accounting(store)


def test_a_hold_in_use_by_a_gpu_copy_neither_expires_nor_ends_until_the_copy_has_landed():
    """A CUDA store copies into its reservation's pages, a CUDA load out of its lease's: while the copy
    runs (a store may wait long for its engine's forward) the hold must keep its pages, or they would
    go to another session's blocks under the copy. It outlives its time to live, and its own
    session cannot release, abort, commit or write it; once the copy has landed, all is as before."""
    store, clock = make_store(pages=16)
    ns = store.register(spec(block_bytes=PAGE))
    store_blocks(store, ns, chain_hashes("l", 4))
    _, lease = store.lookup("s1", ns, chain_hashes("l", 4), pin=True)
    reservation = store.reserve("s1", ns, chain_hashes("r", 4)).reservation
    with store.in_use(reservation), store.in_use(lease):
        clock.now = 11
        assert store.expire() == (0, 0)
        for refused in (
            lambda: store.release("s1", lease.id),
            lambda: store.abort("s1", reservation.id),
            lambda: store.commit("s1", reservation.id),
            lambda: store.check_write(store.reservation("s1", reservation.id), 0, 0, 8),
        ):
            with pytest.raises(FailedPrecondition, match="in use by a GPU copy"):
                refused()
        other = store.reserve("s2", ns, chain_hashes("o", 8))  # the other 8 pages, no more
        assert other.statuses.tolist() == [pb.BLOCK_STATUS_RESERVED] * 8
        assert store.reserve("s2", ns, chain_hashes("p", 1)).statuses.tolist() == [pb.BLOCK_STATUS_NO_SPACE]
        assert_accounting(store)
    assert store.expire() == (1, 1)  # landed: the lease and the reservation expire (s2's is younger)
    assert store.pages.free == 16 - 4 - 8 and store.usage().pinned_blocks == 0
    assert_accounting(store)


def test_commit_errors_are_precise():
    store, _ = make_store()
    ns = store.register(spec(block_bytes=PAGE))
    res = store.reserve("s1", ns, chain_hashes("c", 2)).reservation
    with pytest.raises(PermissionDenied):
        store.commit("intruder", res.id)
    store.commit("s1", res.id)
    with pytest.raises(FailedPrecondition, match="already committed"):
        store.commit("s1", res.id)
    with pytest.raises(NotFound, match="never made"):
        store.commit("s1", 999_999)


def test_eviction_is_lru_and_never_touches_pinned_or_reserved_blocks():
    store, _ = make_store(pages=8)
    ns = store.register(spec(block_bytes=2 * PAGE))  # 4 blocks fit
    a, b, c, d = (chain_hashes(name, 1) for name in "abcd")
    for h in (a, b, c, d):
        store_blocks(store, ns, h)
    _, lease = store.lookup("s1", ns, a, pin=True)  # a pinned
    store.lookup("s1", ns, b, pin=False)  # b recently used
    writing = store.reserve("s2", ns, chain_hashes("e", 1)).reservation  # evicts c (LRU, unpinned)
    assert store.lookup("s", ns, c, pin=False)[0] == 0
    assert store.lookup("s", ns, a, pin=False)[0] == 1
    store_blocks(store, ns, chain_hashes("f", 1))  # evicts d, then nothing else is free
    assert store.lookup("s", ns, d, pin=False)[0] == 0
    result = store.reserve("s3", ns, chain_hashes("g", 3))  # only b and f are evictable: two fit
    assert result.statuses.tolist() == [pb.BLOCK_STATUS_RESERVED, pb.BLOCK_STATUS_RESERVED, pb.BLOCK_STATUS_NO_SPACE]
    assert store.lookup("s", ns, a, pin=False)[0] == 1  # pinned survived
    assert writing.id in store._reservations
    store.release("s1", lease.id)
    assert_accounting(store)


def test_blocks_cleared_while_being_written_are_dropped_at_commit():
    """Clear drops blocks still being written too (DeleteBlocks names committed blocks only): their
    commit makes none of them visible and frees their pages."""
    store, _ = make_store(pages=16)
    ns = store.register(spec(block_bytes=PAGE))
    hashes = chain_hashes("written", 4)
    reservation = store.reserve("s1", ns, hashes).reservation
    assert store.delete(ns, hashes) == 0
    assert store.clear(ns) == 0  # (counts committed blocks)
    assert store.commit("s1", reservation.id) == 0
    assert store.lookup("s1", ns, hashes, pin=False)[0] == 0 and store.pages.free == 16
    assert_accounting(store)


def test_a_lease_extended_by_blocks_it_already_holds_pins_each_once():
    """A pinned lookup extended after a promotion from disk: its new blocks end before the first it
    already holds (a prefix chain never repeats a hash), so each block is pinned once and one release
    unpins them all."""
    store, _ = make_store(pages=16)
    ns = store.register(spec(block_bytes=PAGE))
    a, b, c, d = chain_hashes("extend", 4)
    store_blocks(store, ns, [a, b, c, d])
    _, lease = store.lookup("s1", ns, [a, b], pin=True)
    extended = store.extend_lease("s1", ns, lease, [c, a, d])
    assert extended is lease and [block.hash for block in lease.blocks] == [a, b, c]
    store.release("s1", lease.id)
    assert store.usage().pinned_blocks == 0
    assert_accounting(store)


@pytest.mark.parametrize("how", ["delete", "clear"])
def test_pinned_block_deleted_keeps_its_pages_until_release(how):
    store, _ = make_store(pages=8)
    ns = store.register(spec(block_bytes=PAGE))
    hashes = chain_hashes("d", 3)
    store_blocks(store, ns, hashes)
    _, lease = store.lookup("s1", ns, hashes[:2], pin=True)
    assert (store.delete(ns, hashes) if how == "delete" else store.clear(ns)) == 3
    assert store.lookup("s1", ns, hashes, pin=False)[0] == 0
    assert store.usage().orphan_pages == 2 and store.pages.used == 2  # (the unpinned one went at once)
    assert_accounting(store)
    store.release("s1", lease.id)
    assert store.pages.used == 0
    assert_accounting(store)


def test_store_threshold_admits_on_the_nth_offer():
    store, _ = make_store(store_threshold=3)
    ns = store.register(spec(block_bytes=PAGE))
    h = chain_hashes("t", 1)
    assert store.reserve("s", ns, h).statuses.tolist() == [pb.BLOCK_STATUS_NOT_ADMITTED]
    assert store.reserve("s", ns, h).statuses.tolist() == [pb.BLOCK_STATUS_NOT_ADMITTED]
    assert store.reserve("s", ns, h).statuses.tolist() == [pb.BLOCK_STATUS_RESERVED]


def test_drop_session_releases_leases_and_reservations():
    store, _ = make_store(pages=32)
    ns = store.register(spec(block_bytes=PAGE))
    store_blocks(store, ns, chain_hashes("k", 4))
    store.lookup("dead", ns, chain_hashes("k", 4), pin=True)
    store.reserve("dead", ns, chain_hashes("m", 8))
    assert store.drop_session("dead") == (1, 1)
    usage = store.usage()
    assert usage.reserved_pages == 0 and usage.pinned_blocks == 0 and usage.used_pages == 4


def test_batch_and_hash_length_limits():
    store, _ = make_store(max_batch_blocks=4)
    ns = store.register(spec(block_bytes=PAGE))
    with pytest.raises(InvalidArgument, match="multiple"):
        store.split_hashes(ns, b"x" * 33)
    with pytest.raises(InvalidArgument, match="exceeds"):
        store.split_hashes(ns, b"x" * 32 * 5)
    assert len(store.split_hashes(ns, b"x" * 32 * 4)) == 4


def test_namespace_limit():
    store, _ = make_store(max_namespaces=2)
    store.register(spec(model_id="a", block_bytes=PAGE))
    store.register(spec(model_id="b", block_bytes=PAGE))
    store.register(spec(model_id="a", block_bytes=PAGE))
    with pytest.raises(ResourceExhausted):
        store.register(spec(model_id="c", block_bytes=PAGE))


def test_a_retired_namespace_frees_its_pages_and_keeps_its_counts_only_once_nothing_holds_it():
    store, _ = make_store(max_namespaces=2)
    ns = store.register(spec(model_id="a", block_bytes=2 * PAGE))
    store_blocks(store, ns, [b"a" * 32, b"b" * 32])
    _, lease = store.lookup("s1", ns, [b"a" * 32], pin=True)
    with pytest.raises(FailedPrecondition, match="held"):
        store.retire(ns)
    store.release("s1", lease.id)
    pending = store.reserve("s1", ns, [b"c" * 32]).reservation
    with pytest.raises(FailedPrecondition, match="held"):
        store.retire(ns)
    store.abort("s1", pending.id)
    assert store.retire(ns) == 2
    assert list(store.namespaces) == [] and store.usage().used_pages == 0
    assert (store.retired.stored_blocks, store.retired.hits, store.retired_bytes.stored_blocks) == (2, 1, 4 * PAGE)
    assert_accounting(store)
    again = store.register(spec(model_id="a", block_bytes=2 * PAGE))
    assert again.blocks == {} and again is not ns  # (a new namespace of that id)
    for hold in (  # the retired one holds nothing more: nothing would count or free it
        lambda: store.lookup("s1", ns, [b"a" * 32], pin=True),
        lambda: store.reserve("s1", ns, [b"d" * 32]),
        lambda: store.extend_lease("s1", ns, None, [b"a" * 32]),
    ):
        with pytest.raises(NotFound, match="retired"):
            hold()
    assert store.lookup("s1", ns, [b"a" * 32], pin=False) == (0, None)  # (a look without a hold is harmless)
    assert_accounting(store)


def test_mixed_block_sizes_share_the_pool_with_little_waste():
    """Namespaces with different block sizes under random churn: pages held beyond the bytes
    stored stay below 3% (only each block's last page is partly empty)."""
    page = 32 * 1024
    store = BlockStore(num_pages=4096, page_size=page)  # 128 MiB
    sizes = [2 << 20, 640 << 10, 160 << 10, (2 << 20) + (12 << 10)]
    namespaces = [store.register(spec(block_bytes=s, model_id=f"m{s}")) for s in sizes]
    rng = np.random.default_rng(1)
    worst_waste = 0.0
    for step in range(3000):
        ns = namespaces[rng.integers(len(namespaces))]
        store_blocks(store, ns, [rng.bytes(32) for _ in range(int(rng.integers(1, 8)))])
        if step > 200:
            stored = sum(len(n.blocks) * n.block_bytes for n in namespaces)
            held = store.pages.used * page
            worst_waste = max(worst_waste, 1 - stored / held)
            # the pool stays nearly full: eviction frees only what is needed
            assert store.pages.free * page < max(sizes)
    assert worst_waste < 0.03
    assert_accounting(store)


def test_repeated_hashes_in_a_lookup_pin_each_block_once():
    store, _ = make_store()
    ns = store.register(spec(block_bytes=PAGE))
    a, b = chain_hashes("rep", 2)
    store_blocks(store, ns, [a, b])
    hit, lease = store.lookup("s", ns, [a, b, a, b], pin=True)
    assert hit == 2 and len(lease.blocks) == 2
    store.release("s", lease.id)
    assert store.usage().pinned_blocks == 0
    result = store.reserve("s", ns, chain_hashes("dup", 1) * 3)
    assert result.statuses.tolist() == [pb.BLOCK_STATUS_RESERVED, pb.BLOCK_STATUS_IN_PROGRESS, pb.BLOCK_STATUS_IN_PROGRESS]
    assert_accounting(store)


def test_a_failing_eviction_hook_leaves_the_pool_accounting_straight():
    """Demotion (the eviction hook) is best effort: should it raise, the victims are still evicted and
    their pages reused; nothing is leaked and the store goes on."""
    store, _ = make_store(pages=8)
    ns = store.register(spec(block_bytes=PAGE))
    first = chain_hashes("hook-first", 8)
    store_blocks(store, ns, first)
    seen = []

    def failing_hook(victims):
        seen.extend(v.hash for v in victims)
        raise RuntimeError("the disk tier failed")

    store.on_evict = failing_hook
    second = chain_hashes("hook-second", 2)
    assert store_blocks(store, ns, second).reservation is not None
    assert seen == first[:2] and store.lookup("s1", ns, second, pin=False)[0] == 2
    assert not any(h in ns.blocks for h in first[:2]) and len(ns.blocks) == 8
    assert_accounting(store)
    assert store_blocks(store, ns, chain_hashes("hook-third", 2)).reservation is not None  # still evicting
    assert_accounting(store)


def test_a_reserve_that_cannot_fit_evicts_nothing_for_it():
    """The pool is held by reservations and pins but for three small blocks: a reserve of a block
    larger than all three answers NO_SPACE and leaves them cached; one that fits in part evicts
    only for the blocks that fit."""
    store, _ = make_store(pages=16)
    big, small = store.register(spec(block_bytes=4 * PAGE, model_id="big")), store.register(spec(block_bytes=PAGE))
    assert store.reserve("a", big, chain_hashes("big", 3)).reservation is not None  # 12 pages held
    cached = chain_hashes("small", 4)
    store_blocks(store, small, cached, session="b")
    assert store.lookup("b", small, cached[:1], pin=True)[0] == 1  # 1 pinned, 3 evictable
    assert store.reserve("a", big, chain_hashes("more", 1)).statuses.tolist() == [pb.BLOCK_STATUS_NO_SPACE]
    assert store.lookup("c", small, cached[1:], pin=False)[0] == 3
    two = store.reserve("a", small, chain_hashes("two", 5)).statuses.tolist()
    assert two == [pb.BLOCK_STATUS_RESERVED] * 3 + [pb.BLOCK_STATUS_NO_SPACE] * 2
    assert_accounting(store)


@pytest.mark.parametrize("eviction", ["lru", "arc"])
def test_a_block_answered_present_is_not_evicted_by_the_same_reserve(eviction):
    """A pool full of a prefix's first blocks; another engine reserves the prefix one block longer:
    the blocks it is told are PRESENT ("nothing to do") stay, and the new block gets NO_SPACE, rather
    than the oldest present block making room for it (the engine never stored it again, and the
    whole prefix was unreachable)."""
    store = BlockStore(num_pages=4, page_size=4096, eviction=eviction)
    ns = store.register(spec(block_bytes=4096))
    chain = chain_hashes("present-kept", 5)
    store.commit("a", store.reserve("a", ns, chain[:4]).reservation.id)
    result = store.reserve("b", ns, chain)
    assert result.statuses.tolist() == [pb.BLOCK_STATUS_PRESENT] * 4 + [pb.BLOCK_STATUS_NO_SPACE]
    assert result.reservation is None and store.lookup("b", ns, chain, pin=False)[0] == 4
    other = store.reserve("b", ns, chain[3:4] + chain_hashes("other", 1))  # room made of blocks not in the batch
    assert other.statuses.tolist() == [pb.BLOCK_STATUS_PRESENT, pb.BLOCK_STATUS_RESERVED] and chain[3] in ns.blocks
