"""The data socket: unary KVTier calls over a plain Unix socket next to the gRPC one, with the same
messages, handlers, statuses and metrics; refused frames never take the daemon down; without it
(switched off, or not reachable from the client) the same calls go over gRPC."""

from __future__ import annotations

import asyncio
import re
import signal
import socket
import stat
import struct
import tempfile
import threading
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import grpc
import numpy as np
import pytest
from blocks import spec

from kvtier.client import KVTierClient
from kvtier.data_socket import REQUEST_HEADER, RESPONSE_HEADER, DataSocket
from kvtier.v1 import kvtier_pb2 as pb
from kvtierd.data_socket import DataSocketServer

BLOCK = 4096


def rpc_count(daemon, method: str) -> float:
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{daemon.admin('GetInfo').metrics_port}/metrics").read().decode()
    found = re.search(rf'^kvtierd_rpc_duration_seconds_count{{method="{method}"}} (\S+)$', metrics, re.M)
    return float(found.group(1)) if found else 0.0


def refusal(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as refused:
        call()
    return refused.value.code(), refused.value.details()


def test_calls_go_over_the_data_socket_with_grpcs_results_and_metrics(start_daemon):
    daemon = start_daemon("--pool-size", "64MiB")
    path = daemon.socket.with_name(daemon.socket.name + ".data")
    assert stat.S_ISSOCK(path.stat().st_mode) and stat.S_IMODE(path.stat().st_mode) == 0o660
    data = np.random.default_rng(5).integers(0, 256, (3, BLOCK), dtype=np.uint8)
    hashes = [bytes([i]) * 32 for i in range(3)]
    with KVTierClient(daemon.address) as client:
        assert client.data_socket is not None and client.data_socket.path == path
        lookups_before = rpc_count(daemon, "Lookup")
        ns = client.register(spec(block_bytes=BLOCK))
        assert client.store(ns, hashes, data) == 3
        assert np.array_equal(client.load(ns, hashes), data)
        assert client.lookup(ns, hashes).hit_count == 3
        assert rpc_count(daemon, "Lookup") == lookups_before + 1  # timed by the same wrapper as gRPC calls
        over_socket = refusal(lambda: client.lookup(ns, [b"x" * 3]))
        unknown_namespace = refusal(lambda: client.lookup(_other(ns), hashes))
        socket_path, client._data = client._data, None  # the same calls over gRPC
        assert client.lookup(ns, hashes).hit_count == 3
        assert refusal(lambda: client.lookup(ns, [b"x" * 3])) == over_socket
        assert refusal(lambda: client.lookup(_other(ns), hashes)) == unknown_namespace
        client._data = socket_path
    assert over_socket[0] == grpc.StatusCode.INVALID_ARGUMENT and "multiple of" in over_socket[1]
    assert unknown_namespace[0] == grpc.StatusCode.NOT_FOUND
    # each refusal's log line names its caller: the data socket's connection, then the gRPC peer
    refused = [line for line in daemon.log().splitlines() if "request refused" in line and "multiple of" in line]
    assert len(refused) == 2 and "data-socket:" in refused[0] and "data-socket:" not in refused[1], refused


def _other(ns):
    """The namespace `ns` under an id the daemon never gave out."""
    return replace(ns, id="no-such-namespace")


def raw_call(connection: socket.socket, method: bytes, payload: bytes, length: int | None = None) -> tuple[int, bytes]:
    connection.sendall(REQUEST_HEADER.pack(len(payload) if length is None else length, len(method)) + method + payload)
    header = connection.recv(RESPONSE_HEADER.size, socket.MSG_WAITALL)
    size, status = RESPONSE_HEADER.unpack(header)
    return status, connection.recv(size, socket.MSG_WAITALL) if size else b""


def test_bad_frames_get_a_status_and_the_daemon_keeps_serving(start_daemon):
    daemon = start_daemon("--pool-size", "64MiB", "--max-message-size", "1MiB")
    path = daemon.socket.with_name(daemon.socket.name + ".data")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
        connection.settimeout(10)
        connection.connect(str(path))
        status, message = raw_call(connection, b"Session", b"")
        assert status == grpc.StatusCode.UNIMPLEMENTED.value[0] and b"Session" in message
        status, message = raw_call(connection, b"Lookup", b"\xff\xff\xff")
        assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0] and b"malformed" in message
        request = pb.LookupRequest(session_id="no-such-session", namespace="x", hashes=b"h" * 32).SerializeToString()
        status, _ = raw_call(connection, b"Lookup", request)
        assert status == grpc.StatusCode.UNAUTHENTICATED.value[0]  # as over gRPC: no such session
        status, message = raw_call(connection, b"Commit", b"", length=2 << 20)  # announces 2 MiB, sends none
        assert status == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0] and b"limit" in message
        assert connection.recv(1) == b""  # that connection is closed
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as half:
        half.connect(str(path))
        half.sendall(struct.pack("<I", 10))  # a client that dies in the middle of a frame
    with KVTierClient(daemon.address) as client:
        ns = client.register(spec(block_bytes=BLOCK))
        assert client.data_socket is not None and client.lookup(ns, [b"h" * 32]).hit_count == 0
    assert daemon.process.poll() is None and "data socket request refused" in daemon.log()


def test_without_the_data_socket_calls_go_over_grpc(start_daemon):
    off = start_daemon("--pool-size", "64MiB", "--data-socket", "false")
    assert not off.socket.with_name(off.socket.name + ".data").exists()
    offered = start_daemon("--pool-size", "64MiB")
    offered.socket.with_name(offered.socket.name + ".data").unlink()  # offered, but not reachable from here
    for daemon in (off, offered):
        with KVTierClient(daemon.address) as client:
            assert client.data_socket is None
            ns = client.register(spec(block_bytes=BLOCK))
            data = np.full((1, BLOCK), 7, dtype=np.uint8)
            assert client.store(ns, [b"k" * 32], data) == 1
            assert np.array_equal(client.load(ns, [b"k" * 32]), data)


class _AnswersEarly:
    """Handlers that answer the way a GPU load does: before they end."""

    async def Load(self, request: pb.LoadRequest, context) -> pb.LoadResponse:  # noqa: N802
        size = request.lease_id
        context.answer_now(pb.LoadResponse(block_count=size, data=b"x" * size))
        await asyncio.sleep(0)
        if size == 3:
            await context.abort(grpc.StatusCode.INTERNAL, "refused after the answer went out")
        return pb.LoadResponse(block_count=0)  # dropped: the call has its answer

    async def Lookup(self, request: pb.LookupRequest, context) -> pb.LookupResponse:  # noqa: N802
        return pb.LookupResponse(hit_count=len(request.hashes))


def test_an_answer_sent_before_the_handler_ends_is_the_calls_only_answer(tmp_path):
    """One frame per call whatever the handler does after answering, and an answer larger than the
    socket takes at once arrives whole (its rest through the event loop)."""
    loop = asyncio.new_event_loop()
    serving = threading.Thread(target=loop.run_forever, daemon=True)
    serving.start()
    server = DataSocketServer(_AnswersEarly(), tmp_path / "data", 64 << 20)
    asyncio.run_coroutine_threadsafe(server.start(), loop).result()
    client = DataSocket(tmp_path / "data", timeout=10)
    try:
        for size in (5, 3, 8 << 20):
            answer = client.call("Load", pb.LoadRequest(lease_id=size))
            assert answer.block_count == size and answer.data == b"x" * size
            assert client.call("Lookup", pb.LookupRequest(hashes=b"abc")).hit_count == 3  # the framing holds
    finally:
        client.close()
        asyncio.run_coroutine_threadsafe(_closed(server), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        serving.join()
        loop.close()


async def _closed(server: DataSocketServer) -> None:
    server.close()
    await asyncio.gather(*(asyncio.all_tasks() - {asyncio.current_task()}), return_exceptions=True)


def stored_blocks(client: KVTierClient) -> tuple:
    """A namespace holding three blocks: (namespace, their hashes)."""
    ns = client.register(spec(block_bytes=BLOCK))
    hashes = [bytes([i]) * 32 for i in range(3)]
    assert client.store(ns, hashes, np.zeros((3, BLOCK), dtype=np.uint8)) == 3
    return ns, hashes


def loaded_blocks(daemon, ns) -> int:
    """The namespace's blocks counted as loaded: by the RAM tier and by the engines' sessions."""
    tier = daemon.admin("GetStats", namespace=ns.id).tiers[0].loaded_blocks
    engines = sum(engine.loaded_blocks for engine in daemon.admin("ListEngines").engines)
    assert tier == engines
    return tier


def send_and_vanish(daemon, method: str, request: bytes) -> None:
    """Send a call on the data socket and close the connection before the daemon (stopped
    meanwhile) can answer; return once the daemon has found its answer undelivered."""
    daemon.process.send_signal(signal.SIGSTOP)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
            connection.connect(str(daemon.socket.with_name(daemon.socket.name + ".data")))
            connection.sendall(REQUEST_HEADER.pack(len(request), len(method)) + method.encode() + request)
    finally:
        daemon.process.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + 10
    while "answer undelivered" not in daemon.log() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert re.search(rf"data socket answer undelivered: the client went away method={method}\b", daemon.log())


def test_a_lease_the_client_named_is_kept_when_the_answer_naming_it_is_lost(start_daemon):
    """A shm Load by a lease the client holds (from its pinned Lookup): should its answer be lost,
    the lease stays the client's to release (it may be reading the pages it was given)."""
    daemon = start_daemon("--pool-size", "64MiB", "--lease-ttl", "120")
    with KVTierClient(daemon.address) as client:
        ns, hashes = stored_blocks(client)
        lease = client.lookup(ns, hashes, pin=True).lease_id
        request = pb.LoadRequest(session_id=client.state.session_id, namespace=ns.id, lease_id=lease, transport=pb.TRANSPORT_SHM)
        send_and_vanish(daemon, "Load", request.SerializeToString())
        assert daemon.admin("GetStats").pinned_blocks == 3
        assert loaded_blocks(daemon, ns) == 0  # (its client read no page)
        client.release(lease)  # still the client's
        assert daemon.admin("GetStats").pinned_blocks == 0


@pytest.mark.parametrize("call", ["Lookup", "LookupBatch", "Load", "Reserve"])
def test_a_client_gone_before_its_answer_leaves_nothing_held(start_daemon, call):
    """A call whose client closed the connection before the answer came: the lease or reservation
    it made is ended at once (the client never learnt its id), not kept until --lease-ttl."""
    daemon = start_daemon("--pool-size", "64MiB", "--lease-ttl", "120")
    with KVTierClient(daemon.address) as client:
        ns, hashes = stored_blocks(client)
        session, joined = client.state.session_id, b"".join(hashes)
        request = {
            "Lookup": pb.LookupRequest(session_id=session, namespace=ns.id, hashes=joined, pin=True),
            "LookupBatch": pb.LookupBatchRequest(session_id=session, namespace=ns.id, queries=[joined], pin=True),
            "Load": pb.LoadRequest(session_id=session, namespace=ns.id, hashes=joined, transport=pb.TRANSPORT_SHM),
            "Reserve": pb.ReserveRequest(session_id=session, namespace=ns.id, hashes=b"n" * 64, transport=pb.TRANSPORT_SHM),
        }[call]
        send_and_vanish(daemon, call, request.SerializeToString())
        stats = daemon.admin("GetStats")
        assert stats.pinned_blocks == 0 and stats.reserved_bytes == 0
        assert loaded_blocks(daemon, ns) == 0
        assert client.lookup(ns, hashes).hit_count == 3  # the session goes on
        client.load(ns, hashes)
        assert loaded_blocks(daemon, ns) == 3  # (a delivered load counts)


def test_a_load_counts_as_loaded_once_its_answer_is_written(start_daemon):
    """A load's blocks count as loaded once its answer is written, not while its client has not
    read it: counted at once and taken back when the client vanished, a Prometheus scrape in
    between would see the counter go down. (An inline load: its 32 MiB answer is far more than
    the sockets buffer, whatever the host's settings.)"""
    blocks, block_bytes = 512, 64 << 10
    daemon = start_daemon("--pool-size", "64MiB", "--max-message-size", "64MiB")
    with KVTierClient(daemon.address) as client:
        ns = client.register(spec(block_bytes=block_bytes))
        hashes = [i.to_bytes(32, "little") for i in range(1, blocks + 1)]
        assert client.store(ns, hashes, np.zeros((blocks, block_bytes), dtype=np.uint8)) == blocks
        request = pb.LoadRequest(
            session_id=client.state.session_id, namespace=ns.id, hashes=b"".join(hashes), transport=pb.TRANSPORT_INLINE
        ).SerializeToString()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
            connection.connect(str(daemon.socket.with_name(daemon.socket.name + ".data")))
            connection.sendall(REQUEST_HEADER.pack(len(request), 4) + b"Load" + request)
            deadline = time.monotonic() + 10
            while rpc_count(daemon, "Load") == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert rpc_count(daemon, "Load") == 1  # (the handler is done: its answer is being written)
            time.sleep(0.2)
            assert loaded_blocks(daemon, ns) == 0  # and waits for the client to read it
            length, status = RESPONSE_HEADER.unpack(connection.recv(RESPONSE_HEADER.size, socket.MSG_WAITALL))
            assert status == 0 and len(connection.recv(length, socket.MSG_WAITALL)) == length
            while loaded_blocks(daemon, ns) < blocks and time.monotonic() < deadline:
                time.sleep(0.05)
            assert loaded_blocks(daemon, ns) == blocks


class Interrupted(Exception):
    pass


def test_a_call_cut_off_by_any_exception_leaves_no_answer_for_the_next_call(start_daemon):
    """A call interrupted by something other than an OSError (a signal handler's exception, Ctrl-C)
    while the daemon is stopped: its late answer must not be read as the next call's."""
    daemon = start_daemon("--pool-size", "64MiB")
    first, second = [bytes([1, i]) * 16 for i in range(3)], [bytes([2, i]) * 16 for i in range(3)]
    with KVTierClient(daemon.address, timeout=30) as client:
        ns = client.register(spec(block_bytes=BLOCK))
        client.store(ns, first, np.full((3, BLOCK), 0xAA, dtype=np.uint8))
        client.store(ns, second, np.full((3, BLOCK), 0x55, dtype=np.uint8))

        def interrupt(signum, frame):
            raise Interrupted

        previous = signal.signal(signal.SIGALRM, interrupt)
        daemon.process.send_signal(signal.SIGSTOP)
        try:
            signal.setitimer(signal.ITIMER_REAL, 0.3)
            with pytest.raises(Interrupted):
                client.load(ns, first)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)
            daemon.process.send_signal(signal.SIGCONT)
        assert (client.load(ns, second) == 0x55).all()


def test_a_daemon_trickling_its_answer_does_not_stretch_the_timeout(tmp_path):
    """The timeout bounds the whole call, not each read."""
    path = tmp_path / "slow.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen()

    def trickle():
        connection, _ = server.accept()
        with connection:
            for _ in range(20):  # one byte every 0.2 s: a whole (empty) answer after 1 s
                try:
                    connection.sendall(b"\x00")
                except BrokenPipeError:  # (the client gave up, as it should)
                    return
                time.sleep(0.2)

    threading.Thread(target=trickle, daemon=True).start()
    client = DataSocket(path, timeout=0.5)
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as late:
        client.call("Lookup", pb.LookupRequest())
    assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - started < 1.5
    server.close()


def test_connections_of_threads_that_ended_are_closed(start_daemon):
    """One connection per calling thread: those of threads that ended go when the next is opened."""
    daemon = start_daemon("--pool-size", "64MiB")
    with KVTierClient(daemon.address) as client:
        ns = client.register(spec(block_bytes=BLOCK))
        for _ in range(20):
            thread = threading.Thread(target=client.lookup, args=(ns, [b"h" * 32]))
            thread.start()
            thread.join()
        assert len(client.data_socket._connections) <= 2  # this thread's and the last thread's


def test_a_request_over_the_message_limit_is_refused_without_losing_the_session(start_daemon, monkeypatch):
    from kvtier.ops import SessionState  # noqa: PLC0415

    monkeypatch.setattr(SessionState, "max_inline_blocks", lambda self, block_bytes: 5)  # (else split to fit)
    daemon = start_daemon("--pool-size", "64MiB", "--max-message-size", "1MiB")
    with KVTierClient(daemon.address) as client:
        ns = client.register(spec(block_bytes=256 << 10))
        session = client.state.session_id
        data = np.zeros((5, 256 << 10), dtype=np.uint8)
        with pytest.raises(grpc.RpcError) as refused:
            client.store(ns, [bytes([i]) * 32 for i in range(5)], data, transport="inline")  # a 1.25 MiB Commit
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert client.connected and client.state.session_id == session
        assert client.lookup(ns, [b"h" * 32]).hit_count == 0


def test_connecting_a_connected_client_keeps_its_session(start_daemon):
    daemon = start_daemon("--pool-size", "64MiB")
    with KVTierClient(daemon.address) as client:
        client.connect()
        assert len(daemon.admin("ListEngines").engines) == 1


def test_a_client_without_a_timeout_calls_over_the_data_socket(start_daemon):
    daemon = start_daemon("--pool-size", "64MiB")
    with KVTierClient(daemon.address, timeout=None) as client:
        ns = client.register(spec(block_bytes=BLOCK))
        assert client.data_socket is not None and client.lookup(ns, [b"h" * 32]).hit_count == 0


def on_uvloop(check) -> None:
    """Run `check(reader, writer, peer)` on uvloop, the daemon's event loop, over a connected pair of
    Unix sockets (the daemon's side opened as the data socket server opens its connections)."""
    import uvloop

    async def run() -> None:
        ours, peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        with peer:
            reader, writer = await asyncio.open_unix_connection(sock=ours)
            try:
                await check(reader, writer, peer)
            finally:
                writer.close()

    uvloop.run(run())


def test_an_answer_to_a_connection_the_client_reset_is_undelivered():
    """A client that closes with an answer of ours unread resets the connection, and the event loop
    closes it: the next answer is undelivered (its holds then end) instead of raising an error
    uvloop gives for writes to closed connections (RuntimeError), which skipped that."""
    from kvtierd import data_socket

    async def check(reader, writer, peer) -> None:
        writer.write(b"an answer the client never reads")
        await writer.drain()
        peer.close()
        with pytest.raises(ConnectionResetError):
            await reader.read(1)
        with pytest.raises(ConnectionError):
            await data_socket._answer(writer, 0, b"the next answer")

    on_uvloop(check)


def test_an_answer_the_client_does_not_read_in_time_closes_its_connection(monkeypatch):
    """An answer still unread after ANSWER_WRITE_TIMEOUT_S is undelivered and its connection closed,
    so that a client that never reads does not keep answers of up to --max-message-size in memory."""
    from kvtierd import data_socket

    monkeypatch.setattr(data_socket, "ANSWER_WRITE_TIMEOUT_S", 0.3)

    async def check(reader, writer, peer) -> None:
        started = time.monotonic()
        with pytest.raises(ConnectionError, match="did not read its answer"):
            await data_socket._answer(writer, 0, b"x" * (32 << 20))
        assert time.monotonic() - started < 5 and writer.transport.is_closing()

    on_uvloop(check)


def test_a_request_that_stops_halfway_closes_its_connection(monkeypatch):
    """A request not whole within REQUEST_READ_TIMEOUT_S of its header closes its connection, so that
    a client that stops halfway does not keep up to --max-message-size of it in the daemon's memory
    (sixteen such connections held a GiB, for good); a whole request in time is served as usual."""
    import uvloop

    from kvtierd import data_socket

    monkeypatch.setattr(data_socket, "REQUEST_READ_TIMEOUT_S", 0.3)

    class Service:
        async def Lookup(self, request, context):  # noqa: N802
            return pb.LookupResponse(hit_count=7)

    async def run(path: Path) -> None:
        server = DataSocketServer(Service(), path, 1 << 20)
        await server.start()
        try:
            reader, writer = await asyncio.open_unix_connection(str(path))
            payload = pb.LookupRequest(namespace="n").SerializeToString()
            writer.write(REQUEST_HEADER.pack(len(payload), len(b"Lookup")) + b"Lookup" + payload)
            answer = await asyncio.wait_for(reader.read(64), 5)
            assert pb.LookupResponse.FromString(answer[5:]).hit_count == 7
            writer.write(REQUEST_HEADER.pack(1 << 20, len(b"Lookup")) + b"Lookup" + b"x" * 1000)  # then nothing
            started = time.monotonic()
            assert await asyncio.wait_for(reader.read(64), 5) == b""  # closed by the daemon
            assert 0.25 < time.monotonic() - started < 3
            writer.close()
        finally:
            server.close()

    with tempfile.TemporaryDirectory() as directory:
        uvloop.run(run(Path(directory) / "data.sock"))
