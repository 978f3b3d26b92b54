"""Store, lookup and load through the real daemon over its Unix socket, with both transports."""

import asyncio

import grpc
import numpy as np
import pytest
from blocks import chain_hashes, contents, spec

from kvtier import checksum
from kvtier.aio import AsyncKVTierClient
from kvtier.client import KVTierClient
from kvtier.v1 import kvtier_pb2 as pb


@pytest.mark.parametrize("transport", ["shm", "inline"])
@pytest.mark.parametrize("block_bytes", [96 * 1024, 32 * 1024, 5000])
def test_round_trip_is_byte_exact(client, transport, block_bytes):
    ns = client.register(spec(block_bytes=block_bytes))
    hashes = chain_hashes(f"rt-{transport}-{block_bytes}", 12)
    data = contents(hashes, block_bytes)
    assert client.store(ns, hashes, data, transport=transport) == 12
    assert client.store(ns, hashes, data, transport=transport) == 0  # already present
    assert client.lookup(ns, hashes).hit_count == 12
    for load_transport in ("shm", "inline"):
        assert np.array_equal(client.load(ns, hashes, transport=load_transport), data)
    # a prefix with an unknown tail loads only the present prefix
    mixed = hashes[:5] + chain_hashes("unknown", 3)
    assert np.array_equal(client.load(ns, mixed, transport=transport), data[:5])


def test_second_engine_sees_first_engines_blocks(daemon):
    hashes = chain_hashes("shared", 8)
    data = contents(hashes, 96 * 1024)
    with KVTierClient(daemon.address, engine_name="A") as a:
        ns_a = a.register(spec())
        a.store(ns_a, hashes, data)
    with KVTierClient(daemon.address, engine_name="B") as b:
        ns_b = b.register(spec())
        assert ns_b.id == ns_a.id
        assert np.array_equal(b.load(ns_b, hashes), data)
        other = b.register(spec(model_id="another-model"))
        assert other.id != ns_a.id
        assert b.lookup(other, hashes).hit_count == 0


def test_inline_partial_writes_then_commit(client):
    ns = client.register(spec(block_bytes=70_000))
    hashes = chain_hashes("partial", 2)
    data = contents(hashes, 70_000)
    reservation = client.reserve(ns, hashes)
    for index in range(2):
        for offset in range(0, 70_000, 30_000):
            client.write(reservation.id, index, offset, data[index, offset : offset + 30_000].tobytes())
    assert client.commit(reservation.id) == 2
    assert np.array_equal(client.load(ns, hashes, transport="inline"), data)


def test_pinned_lookup_then_load_by_lease(client):
    ns = client.register(spec())
    hashes = chain_hashes("lease", 4)
    data = contents(hashes, ns.block_bytes)
    client.store(ns, hashes, data)
    result = client.lookup(ns, hashes, pin=True)
    assert result.hit_count == 4 and result.lease_id and result.page_ids.shape == (4, ns.pages_per_block)
    assert np.array_equal(client.load(ns, lease_id=result.lease_id, transport="inline"), data)
    stats = client.admin.GetStats(pb.GetStatsRequest())
    assert stats.pinned_blocks == 0  # the inline load released the lease


def test_eviction_under_pressure_keeps_recent_blocks(start_daemon):
    daemon = start_daemon("--pool-size", "4MiB", "--page-size", "32KiB")
    with KVTierClient(daemon.address) as client:
        ns = client.register(spec(block_bytes=256 * 1024))  # 16 blocks fit
        old = chain_hashes("old", 8)
        client.store(ns, old, contents(old, ns.block_bytes))
        client.lookup(ns, old[:4])  # keep the first four warm
        new = chain_hashes("new", 8)
        assert client.store(ns, new, contents(new, ns.block_bytes)) == 8
        newer = chain_hashes("newer", 4)
        assert client.store(ns, newer, contents(newer, ns.block_bytes)) == 4
        assert client.lookup(ns, old[:4]).hit_count == 4
        assert client.lookup(ns, old[4:]).hit_count == 0
        assert np.array_equal(client.load(ns, newer), contents(newer, ns.block_bytes))
        stats = client.admin.GetStats(pb.GetStatsRequest())
        assert stats.tiers[0].evictions == 4
        assert stats.tiers[0].blocks == 16


def test_store_threshold_through_the_daemon(start_daemon):
    daemon = start_daemon("--pool-size", "16MiB", "--store-threshold", "2")
    with KVTierClient(daemon.address) as client:
        ns = client.register(spec())
        hashes = chain_hashes("admit", 3)
        data = contents(hashes, ns.block_bytes)
        assert client.store(ns, hashes, data) == 0
        assert client.lookup(ns, hashes).hit_count == 0
        assert client.store(ns, hashes, data) == 3
        assert client.lookup(ns, hashes).hit_count == 3


def test_asyncio_client(daemon):
    async def scenario():
        hashes = chain_hashes("async", 6)
        async with AsyncKVTierClient(daemon.address, engine_name="aio") as client:
            ns = await client.register(spec())
            data = contents(hashes, ns.block_bytes)
            stored = await asyncio.gather(client.store(ns, hashes[:3], data[:3]), client.store(ns, hashes[3:], data[3:]))
            assert sum(stored) == 6
            assert (await client.lookup(ns, hashes)).hit_count == 6
            assert np.array_equal(await client.load(ns, hashes), data)
            assert np.array_equal(await client.load(ns, hashes, transport="inline"), data)

    asyncio.run(scenario())


def test_lookup_batch_and_release_many(client):
    ns = client.register(spec())
    first, second = chain_hashes("batch-a", 5), chain_hashes("batch-b", 3)
    client.store(ns, first, contents(first, ns.block_bytes))
    client.store(ns, second[:2], contents(second[:2], ns.block_bytes))
    results = client.lookup_batch(ns, [first, second, chain_hashes("none", 2)], pin=True)
    assert [r.hit_count for r in results] == [5, 2, 0]
    assert results[2].lease_id == 0
    assert client.admin.GetStats(pb.GetStatsRequest()).pinned_blocks == 7
    assert np.array_equal(results[0].checksums, checksum.block_checksums(contents(first, ns.block_bytes)))
    client.release(results[0].lease_id, results[1].lease_id)
    assert client.admin.GetStats(pb.GetStatsRequest()).pinned_blocks == 0


def test_a_refused_pinned_lookup_batch_leaves_no_pin(start_daemon):
    """A pinned LookupBatch is refused whole: for a malformed query after good ones (INVALID_ARGUMENT),
    and for an answer over the message limit (RESOURCE_EXHAUSTED: gRPC would not send it, and the
    client would never learn the leases it made). Neither leaves a block pinned."""
    daemon = start_daemon("--pool-size", "16MiB", "--page-size", "4096", "--max-message-size", "1MiB")
    with KVTierClient(daemon.address) as client:
        ns = client.register(spec(block_bytes=64 * 4096))  # 264 bytes of answer per block: 64 page ids
        hashes = chain_hashes("refused-batch", 8)
        client.store(ns, hashes, contents(hashes, ns.block_bytes))
        with pytest.raises(grpc.RpcError) as malformed:
            client.lookup_batch(ns, [hashes, hashes, b"not a hash"], pin=True)
        assert malformed.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert client.admin.GetStats(pb.GetStatsRequest()).pinned_blocks == 0
        with pytest.raises(grpc.RpcError) as too_big:
            client.lookup_batch(ns, [hashes] * 600, pin=True)  # about 1.3 MB of answer
        assert too_big.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "message limit" in too_big.value.details()
        assert client.admin.GetStats(pb.GetStatsRequest()).pinned_blocks == 0
        assert [r.hit_count for r in client.lookup_batch(ns, [hashes] * 2, pin=True)] == [8, 8]
        assert client.admin.GetStats(pb.GetStatsRequest()).pinned_blocks == 8


def test_load_and_reserve_answers_over_the_message_limit_hold_nothing(start_daemon):
    """Page ids make a Reserve's and a shm Load's answers grow with their blocks: one that would not fit
    in a message is refused (RESOURCE_EXHAUSTED) and its reservation or lease ended, not left to run
    out its time (gRPC would refuse to send it after the handler). A 1 GiB pool of 4 KiB pages that
    is never touched (the blocks are committed with checksums only)."""
    daemon = start_daemon("--pool-size", "1GiB", "--page-size", "4096", "--max-message-size", "1MiB", "--prefault", "false")
    with KVTierClient(daemon.address) as client:
        ns = client.register(spec(block_bytes=64 * 4096))  # 264 bytes of answer per block
        hashes = chain_hashes("big-answers", 4096)
        with pytest.raises(grpc.RpcError) as reserve:
            client.reserve(ns, hashes)
        assert reserve.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "message limit" in reserve.value.details()
        assert client.admin.GetStats(pb.GetStatsRequest()).reserved_bytes == 0
        for half in (hashes[:2048], hashes[2048:]):
            reservation = client.reserve(ns, half)
            assert client.commit(reservation.id, checksums=np.ones(len(half), dtype=np.uint64)) == len(half)
        with pytest.raises(grpc.RpcError) as load:
            client.load(ns, hashes)
        assert load.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "message limit" in load.value.details()
        assert client.admin.GetStats(pb.GetStatsRequest()).pinned_blocks == 0


def test_a_release_of_several_leases_releases_every_one_it_can(client):
    ns = client.register(spec())
    hashes = chain_hashes("release-several", 4)
    client.store(ns, hashes, contents(hashes, ns.block_bytes))
    stale = client.lookup(ns, hashes[:2], pin=True).lease_id
    client.release(stale)
    live = client.lookup(ns, hashes, pin=True).lease_id
    with pytest.raises(grpc.RpcError) as refused:
        client.release(stale, live)
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND and "1 of 2 leases not released" in refused.value.details()
    assert client.admin.GetStats(pb.GetStatsRequest()).pinned_blocks == 0


def test_corrupted_pool_bytes_are_a_miss(daemon, client):
    ns = client.register(spec())
    hashes = chain_hashes("corrupt", 6)
    data = contents(hashes, ns.block_bytes)
    client.store(ns, hashes, data)
    pages = client.lookup(ns, hashes, pin=True)
    view = client.state.pool().view
    view.pages[pages.page_ids[3, 1], 100] ^= 0xFF  # someone scribbles on block 3
    client.release(pages.lease_id)
    for transport in ("shm", "inline"):
        assert np.array_equal(client.load(ns, hashes, transport=transport), data[:3])
    inspected = daemon.admin("InspectBlock", namespace=ns.id, hash=hashes[3])
    assert inspected.stored_checksum and inspected.checksum != inspected.stored_checksum
    intact = daemon.admin("InspectBlock", namespace=ns.id, hash=hashes[2])
    assert intact.checksum == intact.stored_checksum


@pytest.mark.parametrize("data_socket", ["true", "false"])
def test_an_inline_store_larger_than_a_message_goes_in_commits_that_fit(start_daemon, data_socket):
    """40 blocks of 40 kB inline (1.6 MB) against a 1 MiB message limit: the client cuts the store
    into Commits that fit, instead of one refused RESOURCE_EXHAUSTED."""
    daemon = start_daemon("--pool-size", "16MiB", "--max-message-size", "1MiB", "--data-socket", data_socket)
    with KVTierClient(daemon.address) as client:
        ns = client.register(spec(block_bytes=40_000))
        hashes = chain_hashes("inline-split", 40)
        assert client.store(ns, hashes, contents(hashes, 40_000), transport="inline") == 40
        assert np.array_equal(client.load(ns, hashes, transport="inline"), contents(hashes, 40_000))


@pytest.mark.parametrize("data_socket", ["true", "false"])
def test_a_refused_commit_leaves_nothing_reserved(start_daemon, monkeypatch, data_socket):
    """A store whose Commit the daemon refuses (here one made too large on purpose) aborts its
    reservation: its pages are not held, nor its blocks "being written" for other engines, until
    --lease-ttl. (The client's calls failed past the store's op, which never got to abort.)"""
    from kvtier.ops import SessionState  # noqa: PLC0415

    monkeypatch.setattr(SessionState, "max_inline_blocks", lambda self, block_bytes: 40)
    daemon = start_daemon(
        "--pool-size", "16MiB", "--max-message-size", "1MiB", "--lease-ttl", "600", "--data-socket", data_socket
    )
    with KVTierClient(daemon.address, engine_name="a") as a, KVTierClient(daemon.address, engine_name="b") as b:
        ns = a.register(spec(block_bytes=40_000))
        b.register(spec(block_bytes=40_000))
        hashes = chain_hashes("refused-commit", 40)
        with pytest.raises(grpc.RpcError) as refused:
            a.store(ns, hashes, contents(hashes, 40_000), transport="inline")
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert daemon.admin("GetStats").reserved_bytes == 0
        assert b.store(ns, hashes[:20], contents(hashes[:20], 40_000)) == 20

    async def refused_with_asyncio() -> None:
        async with AsyncKVTierClient(daemon.address, engine_name="aio") as client:
            ns = await client.register(spec(block_bytes=40_000))
            with pytest.raises(grpc.RpcError):
                await client.store(ns, hashes, contents(hashes, 40_000), transport="inline")
            assert daemon.admin("GetStats").reserved_bytes == 0

    monkeypatch.setattr(SessionState, "max_inline_blocks", lambda self, block_bytes: 30)  # (over 1 MiB: 1.2 MB)
    hashes = chain_hashes("refused-commit-aio", 40)
    asyncio.run(refused_with_asyncio())


@pytest.mark.parametrize("data_socket", ["true", "false"])
def test_inline_loads_of_many_small_blocks_fit_the_message_limit(start_daemon, data_socket):
    """Each block of an inline answer brings an 8-byte checksum besides its bytes: 15,000 blocks of
    64 bytes went over a 1 MiB limit (the client and the daemon counted the bytes alone)."""
    daemon = start_daemon(
        "--pool-size", "128MiB", "--page-size", "4096", "--max-message-size", "1MiB", "--max-batch-blocks", "100000",
        "--data-socket", data_socket,
    )  # fmt: skip
    with KVTierClient(daemon.address) as client:
        ns = client.register(spec(block_bytes=64))
        hashes = chain_hashes("small-inline", 15_360)  # ((1 MiB - 64 KiB) // 64: the bytes alone would fit)
        data = contents(hashes, 64)
        assert client.store(ns, hashes, data) == len(hashes)
        assert np.array_equal(client.load(ns, hashes, transport="inline"), data)
        expect_refused = pb.LoadRequest(
            session_id=client.state.session_id, namespace=ns.id, hashes=b"".join(hashes), transport=pb.TRANSPORT_INLINE
        )
        with pytest.raises(grpc.RpcError) as refused:
            client._stub.Load(expect_refused, timeout=10)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "message limit" in refused.value.details()
