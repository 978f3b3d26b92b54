"""KVTier: the data plane engines call (sessions, register, lookup, load, two-phase store)."""

from __future__ import annotations

import asyncio
import logging

import numpy as np

from kvtier import checksum
from kvtier.pool_view import decode_page_ids
from kvtier.v1 import kvtier_pb2 as pb
from kvtier.v1 import kvtier_pb2_grpc as pb_grpc
from kvtierd import __version__
from kvtierd.block_store import BlockStore, Lease, Namespace, until_repeat
from kvtierd.errors import InvalidArgument, ResourceExhausted, Unimplemented
from kvtierd.fs_tier import FsTier
from kvtierd.metrics import Metrics
from kvtierd.rpc import unary
from kvtierd.sessions import Session, SessionRegistry
from kvtierd.shm_pool import SharedPool

log = logging.getLogger("kvtierd.data")

# Room left in a message for everything but block bytes.
_MESSAGE_OVERHEAD = 64 << 10


class DataService(pb_grpc.KVTierServicer):
    def __init__(
        self,
        store: BlockStore,
        pool: SharedPool,
        sessions: SessionRegistry,
        metrics: Metrics,
        limits: pb.Limits,
        pool_info: pb.PoolInfo,
        fs: FsTier | None = None,
    ) -> None:
        self.store = store
        self.pool = pool
        self.sessions = sessions
        self.metrics = metrics
        self.limits = limits
        self.pool_info = pool_info
        self.fs = fs
        self._closing = asyncio.Event()

    def close_sessions(self) -> None:
        """Shutting down: end every session stream now instead of waiting out the grace period."""
        self._closing.set()

    async def Session(self, request_iterator, context):  # noqa: N802 (gRPC names)
        first = await anext(aiter(request_iterator), None)
        if first is None or first.WhichOneof("kind") != "hello":
            self.metrics.rpc_errors.labels("Session", "INVALID_ARGUMENT").inc()
            log.warning("session refused: first message is not Hello", extra={"peer": context.peer()})
            await context.abort(InvalidArgument.code, "the first message of a session must be Hello")
        session = self.sessions.open(first.hello, context.peer())
        log.info(
            "engine connected",
            extra={"session": session.id, "engine": session.engine_name, "pid": session.pid, "peer": session.peer},
        )
        try:
            yield pb.SessionEvent(session_id=session.id, pool=self.pool_info, server_version=__version__, limits=self.limits)
            # Heartbeats keep the stream alive and need no answer; it ends when the engine leaves or we shut down.
            drained = asyncio.ensure_future(_drain(request_iterator))
            closing = asyncio.ensure_future(self._closing.wait())
            await asyncio.wait({drained, closing}, return_when=asyncio.FIRST_COMPLETED)
            drained.cancel()
            closing.cancel()
        finally:
            self.sessions.close(session.id)
            leases, reservations = self.store.drop_session(session.id)
            log.info(
                "engine disconnected",
                extra={
                    "session": session.id,
                    "engine": session.engine_name,
                    "released_leases": leases,
                    "aborted_reservations": reservations,
                },
            )

    @unary
    def Register(self, request: pb.RegisterRequest, context) -> pb.RegisterResponse:  # noqa: N802
        session = self.sessions.get(request.session_id)
        ns = self.store.register(request.spec)
        if ns.id not in session.namespaces:
            session.namespaces.add(ns.id)
            log.info("namespace registered", extra={"session": session.id, "namespace": ns.id, "model": ns.spec.model_id})
        return pb.RegisterResponse(namespace=ns.id, block_bytes=ns.block_bytes, pages_per_block=ns.pages_per_block)

    def _session_namespace(self, session_id: str, namespace_id: str):
        session = self.sessions.get(session_id)
        ns = self.store.namespace(namespace_id)
        session.require_namespace(ns.id)
        return session, ns

    @unary
    async def Lookup(self, request: pb.LookupRequest, context) -> pb.LookupResponse:  # noqa: N802
        session, ns = self._session_namespace(request.session_id, request.namespace)
        return await self._lookup(session, ns, request.hashes, request.pin)

    @unary
    async def LookupBatch(self, request: pb.LookupBatchRequest, context) -> pb.LookupBatchResponse:  # noqa: N802
        session, ns = self._session_namespace(request.session_id, request.namespace)
        if len(request.queries) > self.limits.max_batch_blocks:
            raise InvalidArgument(f"{len(request.queries)} queries exceed the limit of {self.limits.max_batch_blocks}")
        if self.fs is not None and request.pin:  # promotions of different queries run in parallel
            results = await asyncio.gather(*(self._lookup(session, ns, query, True) for query in request.queries))
        else:
            results = [await self._lookup(session, ns, query, request.pin) for query in request.queries]
        return pb.LookupBatchResponse(results=results)

    async def _find(self, session_id: str, ns: Namespace, blocks: list[bytes], pin: bool) -> tuple[int, Lease | None]:
        """The longest prefix present in either tier; with `pin`, its blocks on disk are promoted into the
        pool (read in parallel) and the whole prefix pinned under one lease."""
        if pin:
            blocks = until_repeat(blocks)
        hit, lease = self.store.lookup(session_id, ns, blocks, pin)
        if self.fs is None or hit == len(blocks):
            return hit, lease
        more, from_disk = self.fs.lookup(ns, blocks[hit:])
        if not pin or not from_disk:
            return hit + more, lease
        await self.fs.promote(ns, from_disk)
        lease = self.store.extend_lease(session_id, ns, lease, blocks[hit : hit + more])
        return (len(lease.blocks) if lease is not None else 0), lease

    async def _lookup(self, session: Session, ns: Namespace, hashes: bytes, pin: bool) -> pb.LookupResponse:
        blocks = self.store.split_hashes(ns, hashes)
        hit, lease = await self._find(session.id, ns, blocks, pin)
        counters = session.counters
        counters.lookups += 1
        counters.hit_blocks += hit
        counters.miss_blocks += len(blocks) - hit
        if lease is None:
            return pb.LookupResponse(hit_count=hit)
        return pb.LookupResponse(
            hit_count=hit,
            lease_id=lease.id,
            page_ids=lease.page_ids,
            lease_ttl_ms=self.limits.lease_ttl_ms,
            checksums=self._checksums(lease),
        )

    def _checksums(self, lease: Lease) -> bytes:
        return checksum.encode(self.store.checksum[lease.slots])

    @unary
    async def Load(self, request: pb.LoadRequest, context) -> pb.LoadResponse:  # noqa: N802
        session, ns = self._session_namespace(request.session_id, request.namespace)
        transport = _check_transport(request.transport)
        if request.lease_id:
            lease = self.store.lease(session.id, request.lease_id)
            if lease.namespace is not ns:
                raise InvalidArgument(f"lease {lease.id} is for namespace {lease.namespace.id}, not {ns.id}")
        else:
            _, lease = await self._find(session.id, ns, self.store.split_hashes(ns, request.hashes), pin=True)
            if lease is None:
                return pb.LoadResponse(block_count=0)
        self.store.note_loaded(lease)
        session.counters.loaded_blocks += len(lease.blocks)
        session.counters.loaded_bytes += len(lease.blocks) * ns.block_bytes
        if transport == pb.TRANSPORT_SHM:
            return pb.LoadResponse(
                block_count=len(lease.blocks), lease_id=lease.id, page_ids=lease.page_ids, checksums=self._checksums(lease)
            )
        return self._load_inline(session.id, lease)

    def _load_inline(self, session_id: str, lease: Lease) -> pb.LoadResponse:
        ns = lease.namespace
        try:
            size = len(lease.blocks) * ns.block_bytes
            if size > self.limits.max_message_bytes - _MESSAGE_OVERHEAD:
                raise ResourceExhausted(
                    f"inline load of {size} bytes exceeds the message limit of {self.limits.max_message_bytes} "
                    "bytes; load fewer blocks per call or use TRANSPORT_SHM"
                )
            data = self.pool.view.read_blocks(decode_page_ids(lease.page_ids, ns.pages_per_block), ns.block_bytes)
            return pb.LoadResponse(block_count=len(lease.blocks), data=data.tobytes(), checksums=self._checksums(lease))
        finally:
            self.store.release(session_id, lease.id)

    @unary
    def Release(self, request: pb.ReleaseRequest, context) -> pb.ReleaseResponse:  # noqa: N802
        session = self.sessions.get(request.session_id)
        for lease_id in [request.lease_id, *request.more_lease_ids] if request.lease_id else request.more_lease_ids:
            self.store.release(session.id, lease_id)
        return pb.ReleaseResponse()

    @unary
    def Reserve(self, request: pb.ReserveRequest, context) -> pb.ReserveResponse:  # noqa: N802
        session, ns = self._session_namespace(request.session_id, request.namespace)
        _refuse_cuda_ipc(request.transport)
        result = self.store.reserve(session.id, ns, self.store.split_hashes(ns, request.hashes))
        response = pb.ReserveResponse(status=result.statuses.tolist())
        if result.reservation is not None:
            response.reservation_id = result.reservation.id
            response.page_ids = result.reservation.page_ids
            response.lease_ttl_ms = self.limits.lease_ttl_ms
        return response

    @unary
    def Write(self, request: pb.WriteRequest, context) -> pb.WriteResponse:  # noqa: N802
        session = self.sessions.get(request.session_id)
        reservation = self.store.reservation(session.id, request.reservation_id)
        block = self.store.check_write(reservation, request.index, request.offset, len(request.data))
        self.pool.view.write_range(np.frombuffer(block.pages, dtype="<u4"), request.offset, request.data)
        return pb.WriteResponse()

    @unary
    def Commit(self, request: pb.CommitRequest, context) -> pb.CommitResponse:  # noqa: N802
        session = self.sessions.get(request.session_id)
        reservation = self.store.reservation(session.id, request.reservation_id)
        ns = reservation.namespace
        if request.data:
            expected = len(reservation.blocks) * ns.block_bytes
            if len(request.data) != expected:
                raise InvalidArgument(
                    f"commit data has {len(request.data)} bytes; the reservation's {len(reservation.blocks)} blocks "
                    f"of {ns.block_bytes} bytes need exactly {expected}"
                )
            blocks = np.frombuffer(request.data, dtype=np.uint8).reshape(len(reservation.blocks), ns.block_bytes)
            self.pool.view.write_blocks(decode_page_ids(reservation.page_ids, ns.pages_per_block), blocks)
            sums = checksum.block_checksums(blocks)
        else:
            sums = checksum.decode(request.checksums) if len(request.checksums) % 8 == 0 else None
            if sums is None:
                raise InvalidArgument(f"checksums field has {len(request.checksums)} bytes, not a multiple of 8")
        committed = self.store.commit(session.id, reservation.id, sums)
        if self.fs is not None:
            self.fs.write_through(ns, reservation.blocks)
        session.counters.stored_blocks += committed
        session.counters.stored_bytes += committed * ns.block_bytes
        return pb.CommitResponse(committed_count=committed)

    @unary
    def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:  # noqa: N802
        session = self.sessions.get(request.session_id)
        self.store.abort(session.id, request.reservation_id)
        return pb.AbortResponse()


async def _drain(request_iterator) -> None:
    async for _ in request_iterator:
        pass


def _refuse_cuda_ipc(transport: int) -> None:
    if transport == pb.TRANSPORT_CUDA_IPC:
        raise Unimplemented("TRANSPORT_CUDA_IPC is not available in this daemon build")


def _check_transport(transport: int) -> int:
    """Loads say how bytes come back: through the mapped pool or inside the response."""
    _refuse_cuda_ipc(transport)
    if transport not in (pb.TRANSPORT_SHM, pb.TRANSPORT_INLINE):
        raise InvalidArgument(f"transport must be TRANSPORT_SHM or TRANSPORT_INLINE, got {transport}")
    return transport
