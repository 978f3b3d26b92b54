"""Sessions and liveness: a dead client's holds are released at once; concurrent clients keep invariants."""

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from blocks import chain_hashes, spec

from kvtier.client import KVTierClient
from kvtier.v1 import kvtier_pb2 as pb
from kvtierd.block_store import BlockStore
from kvtierd.data_service import DataService
from kvtierd.gpu_transfers import GpuTransfers
from kvtierd.metrics import Metrics
from kvtierd.sessions import SessionRegistry

WORKER = str(Path(__file__).parent / "worker.py")


def pool_accounting(daemon):
    stats = daemon.admin("GetStats")
    namespaces = {n.namespace: n for n in daemon.admin("ListNamespaces").namespaces}
    page_size = daemon.admin("GetInfo").pool.page_size
    committed = sum(n.blocks * -(-n.spec.block_bytes // page_size) * page_size for n in namespaces.values())
    return stats, committed


def test_sigkill_mid_store_releases_everything_at_once(start_daemon):
    daemon = start_daemon("--pool-size", "32MiB", "--lease-ttl", "600")
    worker = subprocess.Popen([sys.executable, WORKER, daemon.address, "hold"], stdout=subprocess.PIPE, text=True)
    try:
        assert worker.stdout.readline().strip() == "holding"
        stats, _ = pool_accounting(daemon)
        assert stats.reserved_bytes > 0 and stats.pinned_blocks == 4 and stats.engines_connected == 1
        worker.kill()
        worker.wait()
        deadline = time.monotonic() + 30  # far below the 600 s lease ttl
        while time.monotonic() < deadline:
            stats, committed = pool_accounting(daemon)
            if stats.engines_connected == 0 and stats.reserved_bytes == 0 and stats.pinned_blocks == 0:
                break
            time.sleep(0.05)
        assert (stats.engines_connected, stats.reserved_bytes, stats.pinned_blocks) == (0, 0, 0)
        assert stats.pool_used_bytes == committed  # no leaked pages
        assert stats.tiers[0].blocks == 4
        assert "aborted_reservations=1" in daemon.log() and "released_leases=1" in daemon.log()
    finally:
        worker.kill()
    with KVTierClient(daemon.address) as client:  # the half-written blocks never became visible
        ns = client.register(spec(block_bytes=40_000))
        assert client.lookup(ns, chain_hashes("half-written", 16)).hit_count == 0
        assert client.lookup(ns, chain_hashes("held", 4)).hit_count == 4


def test_concurrent_clients_never_see_torn_blocks_and_leak_nothing(start_daemon):
    # A pool smaller than the working set, so stores, loads and evictions interleave.
    daemon = start_daemon("--pool-size", "6MiB", "--page-size", "16KiB")
    workers = [
        subprocess.Popen([sys.executable, WORKER, daemon.address, "churn", str(seed), "150"], stdout=subprocess.PIPE, text=True)
        for seed in range(4)
    ]
    outputs = [w.communicate(timeout=240)[0] for w in workers]
    assert all(w.returncode == 0 for w in workers), outputs
    assert all(out.startswith("ok verified=") for out in outputs)
    assert sum(int(out.split("=")[1]) for out in outputs) > 0
    stats, committed = pool_accounting(daemon)
    assert stats.reserved_bytes == 0 and stats.pinned_blocks == 0
    assert stats.pool_used_bytes == committed
    assert stats.tiers[0].evictions > 0


def test_calls_need_a_live_session(daemon):
    client = KVTierClient(daemon.address).connect()
    ns = client.register(spec())
    session_id = client.state.session_id
    client.close()
    deadline = time.monotonic() + 10  # the daemon ends the session once it sees the stream close
    while daemon.admin("GetStats").engines_connected:
        assert time.monotonic() < deadline, "the session outlived its client"
        time.sleep(0.02)
    with KVTierClient(daemon.address) as other:
        stub = other._stub
        with pytest.raises(grpc.RpcError) as err:
            stub.Lookup(pb.LookupRequest(session_id=session_id, namespace=ns.id, hashes=b"x" * 32), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_client_connects_at_once_to_a_daemon_started_after_failed_attempts(tmp_path):
    from daemon import DaemonProcess, new_daemon_dir, remove_daemon_dir

    daemon = DaemonProcess(new_daemon_dir(), ["--pool-size", "16MiB"])
    try:
        for _ in range(3):  # gRPC would otherwise carry a growing reconnect backoff into new channels
            with pytest.raises(ConnectionError, match="UNAVAILABLE"):
                KVTierClient(daemon.address, timeout=10).connect()
        daemon.start()
        started = time.monotonic()
        with KVTierClient(daemon.address, timeout=10) as client:  # with the backoff: UNAVAILABLE at once
            assert client.connected
        assert time.monotonic() - started < 5  # (or a wait of seconds for the channel's next attempt)
    finally:
        daemon.stop()
        remove_daemon_dir(daemon.directory)


def test_an_engine_gone_without_ending_its_session_stream_leaves_no_task_behind():
    """gRPC cancels a Session handler whose engine vanished mid-stream (no end of stream): the tasks
    it watched the stream with go with it, and so does the session."""

    class Peer:  # (what the handler asks of gRPC's context)
        def peer(self) -> str:
            return "unix:engine"

    async def engine_stream():
        yield pb.SessionRequest(hello=pb.Hello(engine_name="vanishing"))
        await asyncio.Event().wait()  # never ends: the engine is gone, its stream never closed

    async def main() -> None:
        store = BlockStore(num_pages=4, page_size=4096)
        sessions = SessionRegistry()
        gpu = GpuTransfers(0, 4096, pool_registered=False)
        service = DataService(store, None, sessions, Metrics(store, sessions), pb.Limits(), pb.PoolInfo(), None, gpu)
        before = asyncio.all_tasks()
        for _ in range(3):
            stream = service.Session(engine_stream(), Peer())
            await anext(stream)  # the SessionEvent
            handler = asyncio.ensure_future(anext(stream))
            await asyncio.sleep(0.01)
            assert len(sessions) == 1
            handler.cancel()  # (as gRPC does)
            with pytest.raises(asyncio.CancelledError):
                await handler
        await asyncio.sleep(0.01)
        assert asyncio.all_tasks() == before and len(sessions) == 0

    asyncio.run(main())
