"""Serves the unary KVTier calls on the data socket (framing in kvtier.data_socket).

Each call goes to the same DataService handler as its gRPC twin, through the same `rpc.unary`
wrapper (timing metrics, error statuses, log lines); a refused call answers its gRPC status code
and message. A connection is served one call at a time, in order; connections run concurrently.
A request larger than --max-message-size is answered RESOURCE_EXHAUSTED and its connection closed.
An answer the client has not taken within ANSWER_WRITE_TIMEOUT_S closes its connection (a client
that never reads would otherwise keep its answers, up to --max-message-size each, in memory), and
so does a request not whole within REQUEST_READ_TIMEOUT_S of its header (a client that stops
halfway would keep what it sent, as much again).
A handler may answer before it ends (`answer_now`: a GPU load answers the moment its bytes are
seen in place, and releases its blocks after). An answer that cannot be written (the client went
away meanwhile) ends the leases and reservations it carried (`on_undelivered`): nobody else knows
their ids, and they would hold their blocks until --lease-ttl. What counts only once the answer is
written (a load's blocks as loaded) waits for it (`on_delivered`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable
from pathlib import Path

import grpc

from kvtier.data_socket import MESSAGES, REQUEST_HEADER, RESPONSE_HEADER
from kvtierd.errors import KVTierError
from kvtierd.rpc import parse

log = logging.getLogger("kvtierd.data_socket")

_OK = 0
ANSWER_WRITE_TIMEOUT_S = 10.0  # the longest an answer may wait for its client to read it
REQUEST_READ_TIMEOUT_S = 10.0  # the longest a request may take to arrive whole once its header has come


class _Refused(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _CallContext:
    """What `rpc.unary` needs of a gRPC context (the peer, and abort: here, raise), `answer_now`,
    `on_undelivered` and `on_delivered`."""

    def __init__(self, peer: str, transport: asyncio.WriteTransport) -> None:
        self._peer = peer
        self._transport = transport
        self.answered = False
        self._let_go: list[Callable[[], None]] = []
        self._when_delivered: list[Callable[[], None]] = []

    def peer(self) -> str:
        return self._peer

    async def abort(self, code: grpc.StatusCode, details: str):
        raise _Refused(code, details)

    def answer_now(self, response) -> None:
        """Send the call's answer at once (on the event loop, before the handler ends); the handler's
        own result or error is then dropped."""
        if not self._transport.is_closing():
            self._transport.write(_frame(_OK, response.SerializeToString()))
            self.answered = True

    def on_undelivered(self, let_go: Callable[[], None]) -> None:
        """Call `let_go` (end the holds the answer carries) should the answer not reach the client."""
        self._let_go.append(let_go)

    def on_delivered(self, action: Callable[[], None]) -> None:
        """Run `action` once the answer is written."""
        self._when_delivered.append(action)

    def delivered(self) -> None:
        for action in self._when_delivered:
            action()

    def undelivered(self, method: str) -> None:
        log.warning("data socket answer undelivered: the client went away", extra={"method": method, "peer": self._peer})
        for let_go in self._let_go:
            with contextlib.suppress(KVTierError):  # (ended with its session already)
                let_go()


class DataSocketServer:
    def __init__(self, service, path: Path, max_message_bytes: int) -> None:
        self.service = service
        self.path = path
        self.max_message_bytes = max_message_bytes
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._ids = itertools.count(1)

    async def start(self) -> None:
        """Create the socket (the caller sets the umask that gives it its mode)."""
        self._server = await asyncio.start_unix_server(self._serve, path=str(self.path))

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._writers):
            writer.close()
        self.path.unlink(missing_ok=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = f"data-socket:{next(self._ids)}"
        self._writers.add(writer)
        try:
            loop = asyncio.get_running_loop()
            while True:
                length, name_length = REQUEST_HEADER.unpack(await reader.readexactly(REQUEST_HEADER.size))
                late = loop.call_later(REQUEST_READ_TIMEOUT_S, writer.transport.abort)  # (a timer: no task per call)
                try:
                    method = (await reader.readexactly(name_length)).decode(errors="replace")
                    if length > self.max_message_bytes:
                        message = f"a {length}-byte request exceeds the limit of {self.max_message_bytes} bytes"
                        log.warning("data socket request refused", extra={"method": method, "reason": message, "peer": peer})
                        await _answer(writer, grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], message.encode())
                        return  # its bytes were not read: the connection cannot go on
                    payload = await reader.readexactly(length)
                finally:
                    late.cancel()
                context = _CallContext(peer, writer.transport)
                status, body = await self._call(method, payload, context)
                if not context.answered:
                    try:
                        await _answer(writer, status, body)
                    except ConnectionError:
                        context.undelivered(method)
                        raise
                context.delivered()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client went away (between calls, or in the middle of one), or never read its answer
        finally:
            self._writers.discard(writer)
            writer.close()

    async def _call(self, method: str, payload: bytes, context: _CallContext) -> tuple[int, bytes]:
        if method not in MESSAGES:
            return grpc.StatusCode.UNIMPLEMENTED.value[0], f"no unary KVTier method {method!r}".encode()
        try:
            response = await getattr(self.service, method)(parse(MESSAGES[method][0])(payload), context)
        except _Refused as refused:
            return refused.code.value[0], refused.details.encode()
        return _OK, response.SerializeToString()


def _frame(status: int, body: bytes) -> bytes:
    return RESPONSE_HEADER.pack(len(body), status) + body


async def _answer(writer: asyncio.StreamWriter, status: int, body: bytes) -> None:
    """Write an answer; ConnectionError when it cannot reach the client: the connection closed (a
    write to a closed transport raises RuntimeError under uvloop) or not read in time."""
    if writer.is_closing():
        raise ConnectionError("the connection closed before the answer")
    writer.write(_frame(status, body))
    drained = writer.drain()  # (raises when the write found the client gone)
    if writer.transport.get_write_buffer_size():  # (the socket took most answers whole: no timer for them)
        drained = asyncio.wait_for(drained, ANSWER_WRITE_TIMEOUT_S)
    try:
        await drained
    except TimeoutError:
        writer.transport.abort()  # (the answer's unsent bytes go with the connection)
        raise ConnectionError(f"the client did not read its answer within {ANSWER_WRITE_TIMEOUT_S} s") from None
