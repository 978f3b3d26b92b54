"""The admin API and kvtierctl against a real daemon (and, for what a test must order, in process)."""

import asyncio
import json
import subprocess
import sys
import threading

import grpc
import numpy as np
import pytest
import xxhash
from blocks import chain_hashes, contents, spec
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from kvtier.client import KVTierClient
from kvtier.v1 import kvtier_pb2 as pb
from kvtierd import admin_service
from kvtierd.admin_service import AdminService
from kvtierd.block_store import BlockStore
from kvtierd.errors import ResourceExhausted
from kvtierd.metrics import Metrics
from kvtierd.sessions import SessionRegistry


def ctl(daemon, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, "-m", "kvtier.ctl", "--address", daemon.address, *args], capture_output=True, text=True
    )
    if check:
        assert result.returncode == 0, result.stderr
    return result


@pytest.fixture
def populated(daemon):
    with KVTierClient(daemon.address, engine_name="engine-a") as client:
        ns_a = client.register(spec(model_id="model-a"))
        ns_b = client.register(spec(model_id="model-b", block_bytes=8192))
        hashes_a = chain_hashes("a", 6)
        hashes_b = chain_hashes("b", 3)
        client.store(ns_a, hashes_a, contents(hashes_a, ns_a.block_bytes))
        client.store(ns_b, hashes_b, contents(hashes_b, ns_b.block_bytes))
        client.lookup(ns_a, hashes_a[:2])
        client.lookup(ns_a, hashes_a[:1])
        client.lookup(ns_b, chain_hashes("missing", 2))
        yield daemon, client, (ns_a, hashes_a), (ns_b, hashes_b)


def test_stats_per_namespace_and_tier(populated):
    daemon, _, (ns_a, _), (ns_b, _) = populated
    stats = daemon.admin("GetStats")
    total = stats.tiers[0]
    assert (total.tier, total.blocks, total.hits, total.misses) == ("ram", 9, 3, 2)
    assert total.bytes == 6 * ns_a.block_bytes + 3 * 8192
    assert total.capacity_bytes == 64 << 20
    per_ns = {n.namespace: n.tiers[0] for n in stats.namespaces}
    assert per_ns[ns_a.id].hits == 3 and per_ns[ns_a.id].hit_ratio == 1.0
    assert per_ns[ns_b.id].misses == 2 and per_ns[ns_b.id].hit_ratio == 0.0
    assert stats.engines_connected == 1
    only_b = daemon.admin("GetStats", namespace=ns_b.id)
    assert [n.namespace for n in only_b.namespaces] == [ns_b.id]


def test_namespaces_engines_and_info(populated):
    daemon, client, (ns_a, _), (ns_b, _) = populated
    namespaces = {n.namespace: n for n in daemon.admin("ListNamespaces").namespaces}
    assert namespaces[ns_a.id].spec.model_id == "model-a" and namespaces[ns_a.id].blocks == 6
    assert namespaces[ns_b.id].engines == 1
    engines = daemon.admin("ListEngines").engines
    assert len(engines) == 1
    engine = engines[0]
    assert engine.engine_name == "engine-a" and engine.session_id == client.state.session_id
    assert (engine.lookups, engine.hit_blocks, engine.miss_blocks, engine.stored_blocks) == (3, 3, 2, 9)
    info = daemon.admin("GetInfo")
    assert info.pool.size_bytes == 64 << 20 and info.config["pool_size"] == str(64 << 20)
    assert info.socket_path == str(daemon.socket) and info.metrics_port > 0


def test_list_blocks_paged_and_ordered(populated):
    daemon, _, (ns_a, hashes_a), _ = populated
    first = daemon.admin("ListBlocks", namespace=ns_a.id, order=pb.BLOCK_ORDER_HITS, page_size=4)
    assert first.total == 6 and len(first.blocks) == 4 and first.next_page_token
    assert first.blocks[0].hash == hashes_a[0] and first.blocks[0].hits == 2
    second = daemon.admin(
        "ListBlocks", namespace=ns_a.id, order=pb.BLOCK_ORDER_HITS, page_size=4, page_token=first.next_page_token
    )
    assert len(second.blocks) == 2 and not second.next_page_token
    assert {b.hash for b in first.blocks} | {b.hash for b in second.blocks} == set(hashes_a)
    recent = daemon.admin("ListBlocks", order=pb.BLOCK_ORDER_RECENCY)
    assert recent.total == 9
    stamps = [b.last_access_at for b in recent.blocks]
    assert stamps == sorted(stamps, reverse=True)


def test_inspect_delete_and_clear(populated):
    daemon, client, (ns_a, hashes_a), (ns_b, hashes_b) = populated
    inspected = daemon.admin("InspectBlock", namespace=ns_a.id, hash=hashes_a[0])
    assert inspected.checksum_xxh3 == xxhash.xxh3_64_hexdigest(contents(hashes_a[:1], ns_a.block_bytes)[0])
    assert inspected.block.size_bytes == ns_a.block_bytes
    assert daemon.admin("DeleteBlocks", namespace=ns_a.id, hashes=hashes_a[2] + hashes_a[3]).deleted_count == 2
    assert client.lookup(ns_a, hashes_a).hit_count == 2
    assert daemon.admin("Clear", namespace=ns_b.id).deleted_count == 3
    assert client.lookup(ns_b, hashes_b).hit_count == 0
    assert daemon.admin("Clear", all=True).deleted_count == 4
    stats = daemon.admin("GetStats")
    assert stats.tiers[0].blocks == 0 and stats.pool_used_bytes == 0


def test_kvtierctl_json_and_tables(populated):
    daemon, _, (ns_a, hashes_a), _ = populated
    doc = json.loads(ctl(daemon, "stats", "--json").stdout)
    assert doc["tiers"][0]["blocks"] == 9 and doc["engines_connected"] == 1
    assert json.loads(ctl(daemon, "--json", "info").stdout)["pool"]["page_size"] == 32768
    table = ctl(daemon, "stats").stdout
    assert "hit ratio" in table and ns_a.id in table
    assert "engine-a" in ctl(daemon, "engines").stdout
    assert "model-a" in ctl(daemon, "namespaces").stdout
    listing = json.loads(ctl(daemon, "blocks", "--namespace", ns_a.id, "--order", "hits", "--limit", "2", "--json").stdout)
    assert listing["blocks"][0]["hash"] == hashes_a[0].hex() and listing["next_page_token"] == "2"
    assert "next page: --page-token 2" in ctl(daemon, "blocks", "--namespace", ns_a.id, "--limit", "2").stdout
    inspected = ctl(daemon, "inspect", ns_a.id, hashes_a[0].hex()).stdout
    assert "checksum (xxh3-64)" in inspected and "intact" in inspected
    for cut in (8, 16):  # two pieces of one 32-byte hash
        split = ctl(daemon, "delete", ns_a.id, hashes_a[4][:cut].hex(), hashes_a[4][cut:].hex(), check=False)
        assert split.returncode != 0 and "hashes have 32 bytes" in split.stderr
    assert ctl(daemon, "delete", ns_a.id, hashes_a[5].hex()).stdout.strip() == "deleted 1 blocks"
    assert ctl(daemon, "clear", "--all").stdout.strip() == "deleted 8 blocks"
    assert ctl(daemon, "health").stdout.strip() == "SERVING"
    failed = ctl(daemon, "inspect", ns_a.id, hashes_a[0].hex(), check=False)
    assert failed.returncode == 2 and "NOT_FOUND" in failed.stderr


def test_kvtierctl_reports_an_absent_daemon(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "kvtier.ctl", "--address", f"unix://{tmp_path}/none.sock", "--timeout", "1", "stats"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2 and "UNAVAILABLE" in result.stderr


def test_health_and_reflection(daemon):
    with grpc.insecure_channel(daemon.address) as channel:
        services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    assert {"kvtier.v1.KVTier", "kvtier.v1.KVTierAdmin", "grpc.health.v1.Health"} <= services


def test_inspect_sees_committed_bytes(daemon):
    with KVTierClient(daemon.address) as client:
        ns = client.register(spec(block_bytes=5000))
        h = chain_hashes("inspect", 1)
        data = np.full((1, 5000), 7, dtype=np.uint8)
        client.store(ns, h, data, transport="inline")
        assert daemon.admin("InspectBlock", namespace=ns.id, hash=h[0]).checksum_xxh3 == xxhash.xxh3_64_hexdigest(data[0])


def service_with_held_ranking(monkeypatch, store: BlockStore) -> tuple[AdminService, threading.Event, threading.Event]:
    """An AdminService of `store` whose ListBlocks ranking, on its thread, sets `ranking` and then
    waits for `gate`."""
    sessions = SessionRegistry()
    info = pb.GetInfoResponse(limits=pb.Limits(max_message_bytes=64 << 20))  # (a default daemon's)
    service = AdminService(store, None, sessions, Metrics(store, sessions), info)
    ranking, gate, real_argsort = threading.Event(), threading.Event(), np.argsort

    def held_argsort(*args, **kwargs):
        ranking.set()
        gate.wait(10)
        return real_argsort(*args, **kwargs)

    monkeypatch.setattr(admin_service.np, "argsort", held_argsort)
    return service, ranking, gate


def test_list_blocks_ranks_on_a_thread_while_the_event_loop_serves(monkeypatch):
    """Ranking every block for ListBlocks (a few hundred ms for a million disk entries) runs on a thread:
    with the ranking held, the event loop still serves (here a lookup), and the page comes after."""
    store = BlockStore(num_pages=64, page_size=4096)
    ns = store.register(spec(block_bytes=4096))
    hashes = chain_hashes("listed", 8)
    store.commit("s", store.reserve("s", ns, hashes).reservation.id)
    service, ranking, gate = service_with_held_ranking(monkeypatch, store)

    async def main() -> None:
        listing = asyncio.ensure_future(AdminService.ListBlocks.__wrapped__(service, pb.ListBlocksRequest(page_size=5), None))
        while not ranking.is_set():
            await asyncio.sleep(0.001)
        assert store.lookup("s", ns, hashes, pin=False)[0] == 8  # served while the ranking is held
        await asyncio.sleep(0.01)
        assert not listing.done()
        gate.set()
        page = await asyncio.wait_for(listing, timeout=10)
        assert len(page.blocks) == 5 and page.total == 8 and page.next_page_token == "5"

    asyncio.run(main())


def test_a_blocks_page_shows_each_block_its_own_figures_when_its_slot_was_reused_meanwhile(monkeypatch):
    """The blocks listed are evicted while the page is ranked on its thread, and new blocks take their
    slots and are pinned and hit: the page shows the listed blocks' figures as they were listed, not
    those of the blocks now in their slots."""
    store = BlockStore(num_pages=8, page_size=4096)
    ns = store.register(spec(block_bytes=4096))
    old, new = chain_hashes("old", 8), chain_hashes("new", 8)
    store.commit("s", store.reserve("s", ns, old).reservation.id)
    service, ranking, gate = service_with_held_ranking(monkeypatch, store)

    async def main() -> pb.ListBlocksResponse:
        listing = asyncio.ensure_future(AdminService.ListBlocks.__wrapped__(service, pb.ListBlocksRequest(page_size=8), None))
        while not ranking.is_set():
            await asyncio.sleep(0.001)
        store.commit("s", store.reserve("s", ns, new).reservation.id)  # (evicts every old block)
        for _ in range(2):
            assert store.lookup("s", ns, new, pin=True)[0] == 8
        gate.set()
        return await asyncio.wait_for(listing, timeout=10)

    page = asyncio.run(main())
    assert {block.hash for block in page.blocks} == set(old) and not any(h in ns.blocks for h in old)
    assert [(block.pins, block.hits) for block in page.blocks] == [(0, 0)] * 8


def test_a_blocks_page_over_the_message_limit_is_refused_and_kvtierctl_refuses_a_limit_below_one(start_daemon):
    """ListBlocks pages of up to 10000 blocks with 64-byte hashes run past a 1 MiB message limit: the
    daemon refuses such a page (RESOURCE_EXHAUSTED, logged) instead of gRPC failing to send it. And
    kvtierctl answers a limit below one with a usage error, not a traceback."""
    daemon = start_daemon("--pool-size", "64MiB", "--page-size", "4096", "--max-message-size", "1MiB", "--prefault", "false")
    with KVTierClient(daemon.address) as client:
        ns = client.register(spec(block_bytes=4096, hash_bytes=64))
        hashes = [h + h for h in chain_hashes("listed", 10_000)]
        for start in range(0, len(hashes), 4000):
            batch = hashes[start : start + 4000]
            assert client.commit(client.reserve(ns, batch).id, checksums=np.ones(len(batch), dtype=np.uint64)) == len(batch)
    refused = ctl(daemon, "blocks", "--limit", "10000", check=False)
    assert refused.returncode != 0 and "RESOURCE_EXHAUSTED" in refused.stderr and "ask for fewer" in refused.stderr
    assert len(json.loads(ctl(daemon, "--json", "blocks", "--limit", "5000").stdout)["blocks"]) == 5000
    negative = ctl(daemon, "blocks", "--limit", "-1", check=False)
    assert negative.returncode == 2 and "not a positive number" in negative.stderr and "Traceback" not in negative.stderr


def test_an_engines_list_over_the_message_limit_is_refused_with_a_reason():
    """ListEngines answers with every session: past the message limit it is refused (RESOURCE_EXHAUSTED,
    logged and counted like any refusal) instead of gRPC failing to send it, unlogged."""
    sessions = SessionRegistry()
    info = pb.GetInfoResponse(limits=pb.Limits(max_message_bytes=64 << 10))
    store = BlockStore(num_pages=16, page_size=4096)
    service = AdminService(store, None, sessions, Metrics(store, sessions), info)
    for i in range(100):
        sessions.open(pb.Hello(engine_name=f"engine-{i}-" + "e" * 240, hostname="h" * 200), "peer")
    assert len(AdminService.ListEngines.__wrapped__(service, pb.ListEnginesRequest(), None).engines) == 100
    for i in range(100):
        sessions.open(pb.Hello(engine_name=f"more-{i}-" + "e" * 240, hostname="h" * 200), "peer")
    with pytest.raises(ResourceExhausted, match="too many engines"):
        AdminService.ListEngines.__wrapped__(service, pb.ListEnginesRequest(), None)
