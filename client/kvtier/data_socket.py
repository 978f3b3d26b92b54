"""The data socket: the unary calls of kvtier.v1.KVTier over a plain Unix socket, and its client.

A gRPC call costs about 0.7 ms of Python between the two processes; a round trip on a Unix socket
costs a few hundredths of that. The daemon therefore also serves every unary KVTier call (Register,
Lookup, Load, Reserve, Commit, ...) on a second socket next to its gRPC socket, with the same
protobuf messages, the same handlers and the same status codes. gRPC stays the contract and the
only way in over TCP; the session (and its cleanup) stays on gRPC.

Framing, both directions little-endian:
  request:  u32 payload length, u8 method-name length, method name (ASCII), serialized request
  response: u32 payload length, u8 status (a grpc.StatusCode number, 0 = OK), serialized response
            or, for a status other than OK, the UTF-8 error message
A connection carries one call at a time, answered in order; the client opens one connection per
calling thread, so calls from several threads still run at once.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from pathlib import Path

import grpc
from google.protobuf.message import DecodeError

from kvtier.v1 import kvtier_pb2 as pb

REQUEST_HEADER = struct.Struct("<IB")
RESPONSE_HEADER = struct.Struct("<IB")
_SERVICE = pb.DESCRIPTOR.services_by_name["KVTier"]
MESSAGES = {  # method name -> (request class, response class), unary calls only
    m.name: (getattr(pb, m.input_type.name), getattr(pb, m.output_type.name))
    for m in _SERVICE.methods
    if not m.client_streaming and not m.server_streaming
}
STATUS_CODES = {code.value[0]: code for code in grpc.StatusCode}


def data_socket_path(grpc_address: str, name: str) -> Path | None:
    """Where the data socket `name` (from SessionEvent.data_socket) is for a client of `grpc_address`:
    next to the gRPC socket as this client sees it (paths may differ between containers), or None
    for a TCP address or when none is offered."""
    if not name or not grpc_address.startswith("unix:"):
        return None
    path = grpc_address.removeprefix("unix:")
    path = "/" + path.lstrip("/") if path.startswith("//") else path
    return Path(path).with_name(name)


class DataSocketError(grpc.RpcError):
    """A failed call, shaped like grpc's errors: `code()` and `details()`. `answered`: the daemon sent
    this status (False: the call failed here, e.g. a timeout). `sent`: the whole request went out
    (False: the daemon cannot have received it)."""

    def __init__(self, code: grpc.StatusCode, details: str, answered: bool = True, sent: bool = True) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details
        self.answered, self.sent = answered, sent

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class DataSocket:
    """Client side: one connection per calling thread, opened on its first call."""

    def __init__(self, path: Path, timeout: float, max_message_bytes: int = 0) -> None:
        self.path = path
        self.timeout = timeout
        self.max_message_bytes = max_message_bytes  # (0: no limit known) the daemon closes on a larger request
        self._local = threading.local()
        self._lock = threading.Lock()
        self._connections: dict[socket.socket, threading.Thread] = {}  # each with the thread it serves
        self._connection()  # a socket that is not there shows now, not at the first call

    def call(self, method: str, request, timeout: float | None = None):
        """The response to `request` (waited for up to `timeout`, default the client's); raises
        DataSocketError with the daemon's status on failure."""
        name = method.encode()
        payload = request.SerializeToString()
        if self.max_message_bytes and len(payload) > self.max_message_bytes:
            message = f"a {len(payload)}-byte {method} request exceeds the daemon's limit of {self.max_message_bytes} bytes"
            raise DataSocketError(grpc.StatusCode.RESOURCE_EXHAUSTED, message, answered=False, sent=False)
        limit = self.timeout if timeout is None else timeout
        deadline = None if limit is None else time.monotonic() + limit  # (None: no timeout)
        connection, sent = None, False
        try:
            connection = self._connection()
            connection.settimeout(None if deadline is None else max(deadline - time.monotonic(), 1e-3))
            connection.sendall(b"".join((REQUEST_HEADER.pack(len(payload), len(name)), name, payload)))
            sent = True
            length, status = RESPONSE_HEADER.unpack(_receive(connection, RESPONSE_HEADER.size, deadline))
            if self.max_message_bytes and length > self.max_message_bytes:  # (not allocated: a garbled header)
                raise ConnectionResetError(f"a {length}-byte answer exceeds the limit of {self.max_message_bytes} bytes")
            body = _receive(connection, length, deadline)
        except OSError as exc:  # a timeout included: the connection's framing is lost, so drop it
            if connection is not None:
                self._drop(connection)
            code = grpc.StatusCode.DEADLINE_EXCEEDED if isinstance(exc, TimeoutError) else grpc.StatusCode.UNAVAILABLE
            raise DataSocketError(code, f"data socket {self.path}: {exc}", answered=False, sent=sent) from None
        except BaseException:  # (KeyboardInterrupt, ...: its late answer would be read as the next call's)
            if connection is not None:
                self._drop(connection)
            raise
        if status:
            raise DataSocketError(STATUS_CODES.get(status, grpc.StatusCode.UNKNOWN), body.decode(errors="replace"))
        try:
            return MESSAGES[method][1].FromString(body)
        except DecodeError as exc:
            raise DataSocketError(grpc.StatusCode.INTERNAL, f"undecodable {method} answer: {exc}") from None

    def close(self) -> None:
        with self._lock:
            connections, self._connections = list(self._connections), {}
        for connection in connections:
            connection.close()

    def _connection(self) -> socket.socket:
        connection = getattr(self._local, "connection", None)
        if connection is None or connection.fileno() < 0:
            connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            connection.settimeout(self.timeout)  # (connecting)
            try:
                connection.connect(str(self.path))
            except OSError:
                connection.close()
                raise
            self._local.connection = connection
            with self._lock:
                ended = [c for c, thread in self._connections.items() if not thread.is_alive()]
                for old in ended:  # (threads that called and are gone: their connections would stay open)
                    del self._connections[old]
                    old.close()
                self._connections[connection] = threading.current_thread()
        return connection

    def _drop(self, connection: socket.socket) -> None:
        with self._lock:
            self._connections.pop(connection, None)
        connection.close()


def _receive(connection: socket.socket, size: int, deadline: float | None) -> bytes:
    """`size` bytes, all by `deadline` (time.monotonic; None: no limit): a daemon sending a few
    bytes at a time does not stretch the call's timeout."""
    buffer = bytearray(size)
    view, received = memoryview(buffer), 0
    while received < size:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("timed out")
            connection.settimeout(left)
        count = connection.recv_into(view[received:])
        if count == 0:
            raise ConnectionResetError("kvtierd closed the data socket")
        received += count
    return bytes(buffer)
