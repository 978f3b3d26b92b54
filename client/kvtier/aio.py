"""asyncio client: the same operations as KVTierClient, awaited."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence

import grpc
import numpy as np

from kvtier import ops
from kvtier.client import DEFAULT_TIMEOUT, channel_options, hello
from kvtier.paths import normalize_address
from kvtier.v1 import kvtier_pb2 as pb
from kvtier.v1 import kvtier_pb2_grpc as pb_grpc


class AsyncKVTierClient:
    def __init__(self, address: str | None = None, engine_name: str = "", timeout: float = DEFAULT_TIMEOUT) -> None:
        self.address = normalize_address(address)
        self.engine_name = engine_name or f"pid-{os.getpid()}"
        self.timeout = timeout
        self.state = ops.SessionState()
        self._channel: grpc.aio.Channel | None = None
        self._stub: pb_grpc.KVTierStub | None = None
        self.admin: pb_grpc.KVTierAdminStub | None = None
        self._closing: asyncio.Event | None = None
        self._watcher: asyncio.Task | None = None

    async def connect(self) -> AsyncKVTierClient:
        """Open a session (a client already in one keeps it)."""
        if self.connected:
            return self
        self._channel = grpc.aio.insecure_channel(self.address, options=channel_options())
        self._stub = pb_grpc.KVTierStub(self._channel)
        self.admin = pb_grpc.KVTierAdminStub(self._channel)
        self._closing = asyncio.Event()
        closing = self._closing

        async def requests():
            yield hello(self.engine_name)
            await closing.wait()

        call = self._stub.Session(requests())
        try:
            event = await asyncio.wait_for(call.read(), self.timeout)
        except TimeoutError:
            call.cancel()
            raise ConnectionError(f"no session from kvtierd at {self.address} within {self.timeout}s") from None
        if event is grpc.aio.EOF:
            raise ConnectionError(f"kvtierd at {self.address} closed the session")
        self.state.session_id = event.session_id
        self.state.pool_info = event.pool
        self.state.limits = event.limits
        self._watcher = asyncio.create_task(self._watch(call))
        return self

    async def _watch(self, call) -> None:
        try:
            while await call.read() is not grpc.aio.EOF:
                pass
        except (grpc.RpcError, asyncio.CancelledError):
            pass

    @property
    def connected(self) -> bool:
        return self._watcher is not None and not self._watcher.done()

    async def close(self) -> None:
        if self._closing is not None:
            self._closing.set()
        if self._watcher is not None:
            self._watcher.cancel()
        self.state.close_pool()
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def __aenter__(self) -> AsyncKVTierClient:
        return await self.connect()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _run(self, op: ops.Op):
        if self._stub is None:
            raise ConnectionError("not connected")
        response = error = None
        try:
            while True:
                method, request = op.send(response) if error is None else op.throw(error)
                error = None
                try:
                    response = await getattr(self._stub, method)(request, timeout=self.timeout)
                except Exception as exc:  # noqa: BLE001 (into the op, which may clean up: ops.Op)
                    error = exc
        except StopIteration as done:
            return done.value
        finally:
            error = None  # (no reference cycle through this frame)

    async def register(self, spec: pb.NamespaceSpec, cuda_kv: pb.CudaKVCache | None = None, replaces: str = "") -> ops.Namespace:
        return await self._run(ops.register(self.state, spec, cuda_kv, replaces))

    async def lookup(self, ns: ops.Namespace, hashes: Sequence[bytes] | bytes, pin: bool = False) -> ops.LookupResult:
        return await self._run(ops.lookup(self.state, ns, hashes, pin))

    async def lookup_batch(
        self, ns: ops.Namespace, queries: Sequence[Sequence[bytes] | bytes], pin: bool = False
    ) -> list[ops.LookupResult]:
        return await self._run(ops.lookup_batch(self.state, ns, queries, pin))

    async def release(self, *lease_ids: int) -> None:
        await self._run(ops.release(self.state, *lease_ids))

    async def load(
        self, ns: ops.Namespace, hashes: Sequence[bytes] | bytes = b"", lease_id: int = 0, transport: str = "shm"
    ) -> np.ndarray:
        return await self._run(ops.load(self.state, ns, hashes, lease_id, transport))

    async def reserve(self, ns: ops.Namespace, hashes: Sequence[bytes] | bytes) -> ops.Reservation:
        return await self._run(ops.reserve(self.state, ns, hashes))

    async def write(self, reservation_id: int, index: int, offset: int, data: bytes) -> None:
        await self._run(ops.write(self.state, reservation_id, index, offset, data))

    async def commit(self, reservation_id: int, data: bytes = b"", checksums: np.ndarray | None = None) -> int:
        return await self._run(ops.commit(self.state, reservation_id, data, checksums))

    async def abort(self, reservation_id: int) -> None:
        await self._run(ops.abort(self.state, reservation_id))

    async def store(self, ns: ops.Namespace, hashes: Sequence[bytes], data: np.ndarray, transport: str = "shm") -> int:
        return await self._run(ops.store(self.state, ns, hashes, data, transport))
