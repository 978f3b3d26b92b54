"""Synchronous client: one session per client, kept open by a background thread."""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Sequence

import grpc
import numpy as np

from kvtier import ops
from kvtier.data_socket import MESSAGES, DataSocket, DataSocketError, data_socket_path
from kvtier.paths import normalize_address
from kvtier.v1 import kvtier_pb2 as pb
from kvtier.v1 import kvtier_pb2_grpc as pb_grpc

log = logging.getLogger("kvtier.client")

DEFAULT_TIMEOUT = 5.0
MAX_MESSAGE_BYTES = 256 << 20
# A cuda_ipc call's deadline is by default its start plus the client's timeout (the connector fixes
# it when it submits the call). The daemon starts no copy that cannot end by then, but one it started
# may end a little later (a busier GPU than it expected, an engine clock up to 1 s ahead of its own):
# the client waits this much longer for the answer.
CUDA_ANSWER_GRACE_S = 5.0
_LOCAL_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED)


def daemon_done_with(exc: BaseException) -> bool:
    """Whether, after a call failed with `exc`, the daemon can no longer be working on it: it sent
    this status (for a cuda_ipc call only once its copies were over), or never got the request.
    False for a failure here (a timeout, a broken connection) that says nothing about its copies;
    over gRPC, for the codes such failures take."""
    if isinstance(exc, DataSocketError):
        return exc.answered or not exc.sent
    return isinstance(exc, grpc.RpcError) and exc.code() not in _LOCAL_CODES


def channel_options(connect_timeout_s: float = 20.0) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        # A channel of its own connects afresh: gRPC's shared subchannels would keep the reconnect
        # backoff of an earlier failure (up to minutes) and fail new channels to a restarted daemon.
        ("grpc.use_local_subchannel_pool", 1),
        # How long a connection attempt may take (gRPC's default: 20 s). A paused daemon accepts and
        # never answers: each abandoned attempt's socket lives this long, even with its channel closed.
        ("grpc.min_reconnect_backoff_ms", max(1000, int(connect_timeout_s * 1000))),
    ]


def hello(engine_name: str) -> pb.SessionRequest:
    return pb.SessionRequest(hello=pb.Hello(engine_name=engine_name, pid=os.getpid(), hostname=socket.gethostname()))


class KVTierClient:
    """Blocking client. `connect()` opens the session; every call raises grpc.RpcError on failure.
    Unary calls go over the daemon's data socket when it offers one (see kvtier.data_socket)."""

    def __init__(self, address: str | None = None, engine_name: str = "", timeout: float = DEFAULT_TIMEOUT) -> None:
        self.address = normalize_address(address)
        self.engine_name = engine_name or f"pid-{os.getpid()}"
        self.timeout = timeout
        self.state = ops.SessionState()
        self._channel: grpc.Channel | None = None
        self._stub: pb_grpc.KVTierStub | None = None
        self._admin: pb_grpc.KVTierAdminStub | None = None
        self._outbox: queue.Queue = queue.Queue()
        self._alive = threading.Event()
        self._alive_lock = threading.Lock()  # (a session ending while connect() finishes stays ended)
        self._data: DataSocket | None = None

    # ------------------------------------------------------------------ session

    def connect(self) -> KVTierClient:
        """Open a session (a client already in one keeps it)."""
        if self.connected:
            return self
        self.close()  # (an ended session's stream thread, channel and data socket go first)
        self._channel = grpc.insecure_channel(self.address, options=channel_options(self.timeout or 20.0))
        self._stub = pb_grpc.KVTierStub(self._channel)
        self._admin = pb_grpc.KVTierAdminStub(self._channel)
        self._outbox = queue.Queue()
        self._outbox.put(hello(self.engine_name))
        call = self._stub.Session(iter(self._outbox.get, None), wait_for_ready=False)
        first: queue.Queue = queue.Queue()
        ended = threading.Event()
        threading.Thread(target=self._watch, args=(call, first, ended), name="kvtier-session", daemon=True).start()
        try:
            event = first.get(timeout=self.timeout)
        except queue.Empty:
            event = ConnectionError(f"no session from kvtierd at {self.address} within {self.timeout}s")
        if isinstance(event, (grpc.RpcError, ConnectionError)):
            self._outbox.put(None)  # (ends gRPC's thread that reads the requests: a hung daemon's retries piled them up)
            call.cancel()
            self._channel.close()  # (and the channel and its socket: a paused daemon's retries piled them up)
            self._channel = None
            if isinstance(event, ConnectionError):
                raise event
            raise ConnectionError(f"kvtierd at {self.address}: {event.code().name}: {event.details()}")
        self.state.session_id = event.session_id
        self.state.pool_info = event.pool
        self.state.limits = event.limits
        self._data = self._open_data_socket(event.data_socket)
        with self._alive_lock:
            if not ended.is_set():
                self._alive.set()
        return self

    def _open_data_socket(self, name: str) -> DataSocket | None:
        path = data_socket_path(self.address, name)
        if path is None:
            return None
        try:
            return DataSocket(path, self.timeout, self.state.limits.max_message_bytes if self.state.limits else 0)
        except OSError as exc:  # e.g. not mounted into this container: gRPC works all the same
            log.info("kvtierd data socket %s unusable (%s); calls go over gRPC", path, exc)
            return None

    @property
    def data_socket(self) -> DataSocket | None:
        """The data socket this session's unary calls use, or None (gRPC)."""
        return self._data

    def _watch(self, call, first: queue.Queue, ended: threading.Event) -> None:
        try:
            for event in call:
                first.put(event)
        except grpc.RpcError as exc:  # (without its traceback: that would hold this frame, and so the client)
            first.put(exc.with_traceback(None))
        finally:
            with self._alive_lock:
                ended.set()
                self._alive.clear()

    @property
    def connected(self) -> bool:
        return self._alive.is_set()

    def close(self) -> None:
        self._outbox.put(None)
        self.state.close_pool()
        if self._data is not None:
            self._data.close()
            self._data = None
        if self._channel is not None:
            self._channel.close()
            self._channel = None
        self._alive.clear()

    def __enter__(self) -> KVTierClient:
        return self if self.connected else self.connect()

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def admin(self) -> pb_grpc.KVTierAdminStub:
        if self._admin is None:
            raise ConnectionError("not connected")
        return self._admin

    def _run(self, op: ops.Op, timeout: float | None = None):
        """Drive `op`, each call waiting up to `timeout` (default: the client's)."""
        if self._stub is None:
            raise ConnectionError("not connected")
        timeout = self.timeout if timeout is None else timeout
        response = error = None
        try:
            while True:
                method, request = op.send(response) if error is None else op.throw(error)
                error = None
                try:
                    if self._data is not None and method in MESSAGES:
                        response = self._data.call(method, request, timeout)
                    else:
                        response = getattr(self._stub, method)(request, timeout=timeout)
                except Exception as exc:  # noqa: BLE001 (into the op, which may clean up: ops.Op)
                    error = exc
        except StopIteration as done:
            return done.value
        finally:
            error = None  # (no reference cycle through this frame)

    def cuda_deadline_ns(self) -> int:
        """The deadline of a cuda_ipc call starting now (see CUDA_ANSWER_GRACE_S)."""
        return time.monotonic_ns() + int(self.timeout * 1e9)

    @staticmethod
    def _cuda_wait(deadline_ns: int) -> float:
        return max(0.0, (deadline_ns - time.monotonic_ns()) / 1e9) + CUDA_ANSWER_GRACE_S

    # ------------------------------------------------------------------ data plane

    def register(self, spec: pb.NamespaceSpec, cuda_kv: pb.CudaKVCache | None = None, replaces: str = "") -> ops.Namespace:
        return self._run(ops.register(self.state, spec, cuda_kv, replaces))

    def lookup(self, ns: ops.Namespace, hashes: Sequence[bytes] | bytes, pin: bool = False) -> ops.LookupResult:
        return self._run(ops.lookup(self.state, ns, hashes, pin))

    def lookup_batch(
        self, ns: ops.Namespace, queries: Sequence[Sequence[bytes] | bytes], pin: bool = False
    ) -> list[ops.LookupResult]:
        return self._run(ops.lookup_batch(self.state, ns, queries, pin))

    def release(self, *lease_ids: int) -> None:
        self._run(ops.release(self.state, *lease_ids))

    def load(
        self, ns: ops.Namespace, hashes: Sequence[bytes] | bytes = b"", lease_id: int = 0, transport: str = "shm"
    ) -> np.ndarray:
        return self._run(ops.load(self.state, ns, hashes, lease_id, transport))

    def load_cuda(  # noqa: PLR0913
        self, ns: ops.Namespace, device_block_ids: Sequence[int], hashes=b"", lease_id: int = 0, deadline_ns: int = 0
    ) -> int:
        """See ops.load_cuda; `deadline_ns` defaults to `cuda_deadline_ns()`, and the answer is waited
        for until CUDA_ANSWER_GRACE_S past it."""
        deadline_ns = deadline_ns or self.cuda_deadline_ns()
        op = ops.load_cuda(self.state, ns, device_block_ids, hashes, lease_id, deadline_ns)
        return self._run(op, self._cuda_wait(deadline_ns))

    def store_cuda(  # noqa: PLR0913
        self, ns: ops.Namespace, hashes: Sequence[bytes], device_block_ids: Sequence[int], ready_event: int, deadline_ns: int = 0
    ) -> int:
        """See ops.store_cuda (`ready_event` is what GpuKV.record_ready returned); the deadline as for
        load_cuda."""
        deadline_ns = deadline_ns or self.cuda_deadline_ns()
        op = ops.store_cuda(self.state, ns, hashes, device_block_ids, ready_event, deadline_ns)
        return self._run(op, self._cuda_wait(deadline_ns))

    def reserve(self, ns: ops.Namespace, hashes: Sequence[bytes] | bytes) -> ops.Reservation:
        return self._run(ops.reserve(self.state, ns, hashes))

    def write(self, reservation_id: int, index: int, offset: int, data: bytes) -> None:
        self._run(ops.write(self.state, reservation_id, index, offset, data))

    def commit(self, reservation_id: int, data: bytes = b"", checksums: np.ndarray | None = None) -> int:
        return self._run(ops.commit(self.state, reservation_id, data, checksums))

    def abort(self, reservation_id: int) -> None:
        self._run(ops.abort(self.state, reservation_id))

    def store(self, ns: ops.Namespace, hashes: Sequence[bytes], data: np.ndarray, transport: str = "shm") -> int:
        return self._run(ops.store(self.state, ns, hashes, data, transport))
