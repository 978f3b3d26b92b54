"""The client acts on no answer it cannot trust: a daemon that answers garbage (a length no message
can have, an undecodable body, more or fewer pages or checksums than blocks, pages outside the pool,
a block size other than the namespace's) costs a failed call, never memory, a hang or wrong data.
Real daemons where the answer can be real; a socket that answers garbage where it cannot."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import grpc
import pytest
from blocks import spec
from daemon import DaemonProcess

from kvtier import ops
from kvtier.client import KVTierClient
from kvtier.data_socket import RESPONSE_HEADER, DataSocket, DataSocketError
from kvtier.v1 import kvtier_pb2 as pb


def garbage_socket(path: Path, answer: bytes) -> threading.Thread:
    """A Unix socket at `path` that answers one connection's first request with `answer`."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(1)

    def serve() -> None:
        connection, _ = server.accept()
        with connection, server:
            connection.recv(1 << 16)
            connection.sendall(answer)
            time.sleep(1)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


@pytest.mark.parametrize(
    "answer,code",
    [
        (RESPONSE_HEADER.pack(0xFFFFFFFF, 0), grpc.StatusCode.UNAVAILABLE),  # a length beyond any message: not allocated
        (RESPONSE_HEADER.pack(8, 0) + b"\xff" * 8, grpc.StatusCode.INTERNAL),  # a body that is no LookupResponse
    ],
)
def test_a_garbled_data_socket_answer_fails_the_call_at_once(tmp_path, answer, code):
    garbage_socket(tmp_path / "data.sock", answer)
    data = DataSocket(tmp_path / "data.sock", timeout=5.0, max_message_bytes=1 << 20)
    started = time.monotonic()
    with pytest.raises(DataSocketError) as failed:
        data.call("Lookup", pb.LookupRequest(session_id="s", namespace="n"))
    assert failed.value.code() == code and time.monotonic() - started < 1.0
    data.close()


@pytest.mark.parametrize(
    "change,why",
    [
        ({"page_ids": b""}, "pages"),  # a lease with no pages for its blocks
        ({"checksums": b""}, "checksums"),  # blocks that could not be verified
        ({"page_ids": (1 << 30).to_bytes(4, "little") * 2}, "pages"),  # pages outside the pool
    ],
)
def test_lookup_and_load_answers_that_do_not_add_up_are_refused(daemon, change, why):
    with KVTierClient(daemon.address) as client:
        ns = client.register(spec(block_bytes=4096))
        answer = pb.LookupResponse(
            hit_count=2, lease_id=7, page_ids=(1).to_bytes(4, "little") * 2, checksums=b"\x00" * 16
        )  # (a consistent answer, then the change)
        ops._lookup_result(client.state, answer, ns)
        for name, value in change.items():
            setattr(answer, name, value)
        with pytest.raises(ValueError, match=why):
            ops._lookup_result(client.state, answer, ns)
        load = ops._load(client.state, ns, b"h" * 32, 0, "shm")
        next(load)
        with pytest.raises(ValueError, match=why):  # (the lease is released all the same)
            load.send(pb.LoadResponse(block_count=2, lease_id=7, **{"page_ids": answer.page_ids, "checksums": answer.checksums}))
            next(load)


def test_a_register_answer_of_another_block_size_is_refused(daemon):
    with KVTierClient(daemon.address) as client:
        register = ops.register(client.state, spec(block_bytes=4096))
        next(register)
        with pytest.raises(ValueError, match="blocks of"):
            register.send(pb.RegisterResponse(namespace="n", block_bytes=4096, pages_per_block=0))


def test_reconnecting_a_client_leaves_no_thread_of_its_ended_session(start_daemon):
    daemon: DaemonProcess = start_daemon("--pool-size", "16MiB")
    client = KVTierClient(daemon.address).connect()
    threads = threading.active_count()
    for _ in range(4):
        assert daemon.stop() == 0
        deadline = time.monotonic() + 10
        while client.connected:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        daemon.start()
        client.connect()
    time.sleep(0.5)
    assert threading.active_count() <= threads + 1
    client.close()
