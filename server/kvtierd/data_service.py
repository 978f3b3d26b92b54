"""KVTier: the data plane engines call (sessions, register, lookup, load, two-phase store)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from functools import partial
from operator import attrgetter

import numpy as np

from kvtier import checksum
from kvtier.ops import BATCH_QUERIES_FACTOR, inline_blocks_fitting
from kvtier.pool_view import decode_page_ids
from kvtier.v1 import kvtier_pb2 as pb
from kvtier.v1 import kvtier_pb2_grpc as pb_grpc
from kvtierd import __version__
from kvtierd.block_store import BlockStore, Lease, Namespace, ReserveResult, until_repeat
from kvtierd.errors import (
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    KVTierError,
    NotFound,
    ResourceExhausted,
)
from kvtierd.fs_tier import FsTier
from kvtierd.gpu_transfers import GpuTransfers
from kvtierd.metrics import Metrics
from kvtierd.rpc import check_sendable, unary
from kvtierd.sessions import Session, SessionRegistry
from kvtierd.shm_pool import SharedPool

log = logging.getLogger("kvtierd.data")

# Loads that end the lease they name, refused or not (a shm load's lease is the client's to release).
_RELEASING = (pb.TRANSPORT_INLINE, pb.TRANSPORT_CUDA_IPC)
MAX_NAME_CHARS = 256  # Hello's engine_name and hostname (every session's go into ListEngines answers)


class DataService(pb_grpc.KVTierServicer):
    def __init__(
        self,
        store: BlockStore,
        pool: SharedPool,
        sessions: SessionRegistry,
        metrics: Metrics,
        limits: pb.Limits,
        pool_info: pb.PoolInfo,
        fs: FsTier | None,
        gpu: GpuTransfers,
        data_socket: str = "",
    ) -> None:
        self.store = store
        self.pool = pool
        self.sessions = sessions
        self.metrics = metrics
        self.limits = limits
        self.pool_info = pool_info
        self.fs = fs
        self.gpu = gpu
        self.data_socket = data_socket  # the data socket's file name, offered to every session
        self._closing = asyncio.Event()

    def close_sessions(self) -> None:
        """Shutting down: end every session stream now instead of waiting out the grace period."""
        self._closing.set()

    async def Session(self, request_iterator, context):  # noqa: N802 (gRPC names)
        first = await anext(aiter(request_iterator), None)
        reason = ""
        if first is None or first.WhichOneof("kind") != "hello":
            reason = "the first message of a session must be Hello"
        elif max(len(first.hello.engine_name), len(first.hello.hostname)) > MAX_NAME_CHARS:
            reason = f"Hello's engine_name and hostname are limited to {MAX_NAME_CHARS} characters"
        if reason:
            self.metrics.rpc_errors.labels("Session", "INVALID_ARGUMENT").inc()
            log.warning("session refused", extra={"reason": reason, "peer": context.peer()})
            await context.abort(InvalidArgument.code, reason)
        session = self.sessions.open(first.hello, context.peer())
        log.info(
            "engine connected",
            extra={"session": session.id, "engine": session.engine_name, "pid": session.pid, "peer": session.peer},
        )
        try:
            yield pb.SessionEvent(
                session_id=session.id,
                pool=self.pool_info,
                server_version=__version__,
                limits=self.limits,
                data_socket=self.data_socket,
            )
            # Heartbeats keep the stream alive and need no answer; it ends when the engine leaves or we shut down.
            drained = asyncio.ensure_future(_drain(request_iterator))
            closing = asyncio.ensure_future(self._closing.wait())
            try:
                await asyncio.wait({drained, closing}, return_when=asyncio.FIRST_COMPLETED)
            finally:  # (also when gRPC cancels this handler: the engine went away without ending its stream)
                drained.cancel()
                closing.cancel()
        finally:
            self.sessions.close(session.id)
            registrations = await self.gpu.close_session(session.id)  # its GPU copies end before its pages go
            leases, reservations = self.store.drop_session(session.id)
            log.info(
                "engine disconnected",
                extra={
                    "session": session.id,
                    "engine": session.engine_name,
                    "released_leases": leases,
                    "aborted_reservations": reservations,
                    "closed_cuda_registrations": registrations,
                },
            )

    @unary
    def Register(self, request: pb.RegisterRequest, context) -> pb.RegisterResponse:  # noqa: N802
        session = self.sessions.get(request.session_id)
        if request.replaces in session.namespaces:
            session.namespaces.discard(request.replaces)
            log.info("namespace left", extra={"session": session.id, "namespace": request.replaces})
        try:
            ns = self.store.register(request.spec)
        except ResourceExhausted:  # (a new namespace, with all --max-namespaces taken)
            if not self._retire_idle_namespace():
                raise
            ns = self.store.register(request.spec)
        if ns.id not in session.namespaces:
            session.namespaces.add(ns.id)
            log.info("namespace registered", extra={"session": session.id, "namespace": ns.id, "model": ns.spec.model_id})
        response = pb.RegisterResponse(namespace=ns.id, block_bytes=ns.block_bytes, pages_per_block=ns.pages_per_block)
        if request.HasField("cuda_kv"):
            try:
                registration = self.gpu.register(session.id, request.cuda_kv, ns.id, ns.block_bytes, request.monotonic_ns)
                response.cuda_registration = registration.id
            except (FailedPrecondition, InvalidArgument) as exc:  # the namespace stands; the engine uses TRANSPORT_SHM
                response.cuda_refused = str(exc)
                log.warning("cuda_ipc refused", extra={"session": session.id, "reason": str(exc)})
            except Exception as exc:  # noqa: BLE001 (e.g. no GPU memory left for the daemon's context): the same
                response.cuda_refused = f"this daemon failed to open the KV cache: {exc}"
                log.exception("cuda_ipc refused", extra={"session": session.id, "reason": str(exc)})
        return response

    def _retire_idle_namespace(self) -> bool:
        """Make room for a new namespace: retire the least recently used one that no connected engine
        has registered and nothing holds, with its blocks in the pool (those on disk stay until the
        tier evicts them, and are found again should the namespace come back). False when there is none."""
        idle = [
            ns for ns in self.store.namespaces.values() if not self.sessions.engines_in(ns.id) and not self.store.holds_any(ns)
        ]
        if not idle:
            return False
        ns = min(idle, key=attrgetter("last_used"))
        deleted = self.store.retire(ns)
        self.metrics.retired_namespaces.inc()
        log.warning(
            "namespace retired to make room for a new one (--max-namespaces)",
            extra={
                "namespace": ns.id,
                "model": ns.spec.model_id,
                "deleted_blocks": deleted,
            },
        )
        return True

    def _session_namespace(self, session_id: str, namespace_id: str):
        session = self.sessions.get(session_id)
        ns = self.store.namespace(namespace_id)
        session.require_namespace(ns.id)
        return session, ns

    @unary
    async def Lookup(self, request: pb.LookupRequest, context) -> pb.LookupResponse:  # noqa: N802
        session, ns = self._session_namespace(request.session_id, request.namespace)
        result = await self._lookup(session, ns, self.store.split_hashes(ns, request.hashes), request.pin)
        return self._sendable(result, partial(self._release_leases, session.id, [result]), context)

    @unary
    async def LookupBatch(self, request: pb.LookupBatchRequest, context) -> pb.LookupBatchResponse:  # noqa: N802
        session, ns = self._session_namespace(request.session_id, request.namespace)
        if len(request.queries) > self.limits.max_batch_blocks:
            raise InvalidArgument(f"{len(request.queries)} queries exceed the limit of {self.limits.max_batch_blocks}")
        queries = [self.store.split_hashes(ns, query) for query in request.queries]  # all checked before any pin
        most = BATCH_QUERIES_FACTOR * self.limits.max_batch_blocks  # (the index work of one call is bounded)
        if sum(map(len, queries)) > most:
            raise InvalidArgument(f"{sum(map(len, queries))} hashes in all exceed the limit of {most} per LookupBatch")
        if self.fs is not None and request.pin:  # promotions of different queries run in parallel
            # (each task runs a turn later: a namespace retired meanwhile is refused by the store's lookup)
            lookups = [asyncio.ensure_future(self._lookup(session, ns, query, True)) for query in queries]
            try:
                results = await asyncio.gather(*lookups)
            except BaseException:  # one failed, or the caller went: the others' pins go too
                self._release_pins(session.id, lookups)
                raise
        else:  # (nothing here waits or fails: all pins or none)
            results = [await self._lookup(session, ns, query, request.pin) for query in queries]
        results = pb.LookupBatchResponse(results=results)
        return self._sendable(results, partial(self._release_leases, session.id, results.results), context)

    def _sendable(self, response, let_go: Callable[[], None], context):
        """The response, when it fits in a message; else `let_go` ends the holds it carries (they would
        be kept until they expire) and the call is refused (rpc.check_sendable). The data socket also
        lets them go should the response not reach its client."""
        try:
            check_sendable(response, self.limits.max_message_bytes, "ask for fewer blocks per call (nothing is held for it)")
        except ResourceExhausted:
            let_go()
            raise
        if (on_undelivered := getattr(context, "on_undelivered", None)) is not None:  # (gRPC: none)
            on_undelivered(let_go)
        return response

    def _release_leases(self, session_id: str, results: list[pb.LookupResponse]) -> None:
        for result in results:
            if result.lease_id:
                with contextlib.suppress(NotFound):
                    self.store.release(session_id, result.lease_id)

    def _release_pins(self, session_id: str, lookups: list[asyncio.Future]) -> None:
        """Release the leases of the pinned lookups that answered; cancel the others (each lets go
        of its own pins)."""
        for lookup in lookups:
            if not lookup.done():
                lookup.cancel()
            elif not lookup.cancelled() and lookup.exception() is None and lookup.result().lease_id:
                with contextlib.suppress(NotFound):
                    self.store.release(session_id, lookup.result().lease_id)

    async def _find(self, session_id: str, ns: Namespace, blocks: list[bytes], pin: bool) -> tuple[int, Lease | None]:
        """The longest prefix present in either tier; with `pin`, its blocks on disk are promoted into the
        pool (read in parallel) and the whole prefix pinned under one lease."""
        if pin:
            blocks = until_repeat(blocks)
            self.sessions.get(session_id)  # (a batch's lookups may start after its session ended: nothing to pin for)
        hit, lease = self.store.lookup(session_id, ns, blocks, pin)
        if self.fs is None or hit == len(blocks):
            return hit, lease
        more, from_disk = self.fs.lookup(ns, blocks[hit:])
        if not pin or not from_disk:
            return hit + more, lease
        try:
            with self.store.held(ns, blocks[hit : hit + more]):  # (the prefix's blocks after a pool miss)
                await self.fs.promote(ns, from_disk)
            self.sessions.get(session_id)  # it may have ended meanwhile (its holds were let go then)
        except BaseException:  # (the caller's deadline, or its session gone): the pool part is let go now
            if lease is not None:
                with contextlib.suppress(NotFound):
                    self.store.release(session_id, lease.id)
            raise
        lease = self.store.extend_lease(session_id, ns, lease, blocks[hit : hit + more])
        if lease is not None:
            self.store.renew(lease)  # (its time to live ran while the blocks were read: the answer announces it whole)
        return (len(lease.blocks) if lease is not None else 0), lease

    async def _lookup(self, session: Session, ns: Namespace, blocks: list[bytes], pin: bool) -> pb.LookupResponse:
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
        try:
            session, ns = self._session_namespace(request.session_id, request.namespace)
            transport = _check_transport(request.transport)
            registration = (
                self.gpu.registration(session.id, request.cuda_ipc.registration_id, ns.id)
                if transport == pb.TRANSPORT_CUDA_IPC
                else None
            )
            if request.lease_id:
                lease = self.store.lease(session.id, request.lease_id)
                if lease.namespace is not ns:
                    raise InvalidArgument(f"lease {lease.id} is for namespace {lease.namespace.id}, not {ns.id}")
        except KVTierError:
            if request.lease_id and request.transport in _RELEASING:  # (its lease goes with the call, refused or not)
                with contextlib.suppress(KVTierError):  # (unknown, or another session's: not ours to end)
                    self.store.release(request.session_id, request.lease_id)
            raise
        if not request.lease_id:
            _, lease = await self._find(session.id, ns, self.store.split_hashes(ns, request.hashes), pin=True)
            if lease is None:
                return pb.LoadResponse(block_count=0)
        if transport == pb.TRANSPORT_SHM:
            response = pb.LoadResponse(
                block_count=len(lease.blocks), lease_id=lease.id, page_ids=lease.page_ids, checksums=self._checksums(lease)
            )
            made_here = not request.lease_id  # (a lease the client named is the client's to release)
            let_go = partial(self.store.release, session.id, lease.id) if made_here else _nothing
            response = self._sendable(response, let_go, context)
        elif registration is not None:
            answer_now = getattr(context, "answer_now", None)  # the data socket's; gRPC answers on return
            response = await self._load_cuda(session.id, lease, registration, request.cuda_ipc, answer_now)
        else:
            response = self._load_inline(session.id, lease)
        count = partial(self._count_loaded, session, lease)  # (only loads that hand their blocks out)
        if (on_delivered := getattr(context, "on_delivered", None)) is not None:
            on_delivered(count)  # the data socket's: once the answer is written (a shm load's pages are read after)
        else:
            count()  # (gRPC tells no delivery: counted on return)
        return response

    def _count_loaded(self, session: Session, lease: Lease) -> None:
        blocks = len(lease.blocks)
        self.store.note_loaded(lease.namespace, blocks)
        session.counters.loaded_blocks += blocks
        session.counters.loaded_bytes += blocks * lease.namespace.block_bytes

    async def _load_cuda(
        self, session_id: str, lease: Lease, registration, target: pb.CudaIpcTarget, answer_now
    ) -> pb.LoadResponse:
        """Copy, verify, answer (at once when `answer_now` is given), then release the lease. Only what
        the copy needs comes before it; the answer is made while its bytes move."""
        ns = lease.namespace
        try:
            count = len(lease.blocks)
            if len(target.device_block_ids) < count:
                raise InvalidArgument(f"{len(target.device_block_ids)} device block ids for {count} blocks to load")
            targets = np.asarray(target.device_block_ids[:count], dtype=np.int64)
            registration.check_blocks(targets, distinct=True)
            pages = decode_page_ids(lease.page_ids, ns.pages_per_block)
            expected = response = None

            def prepare_answer() -> None:
                nonlocal expected, response
                expected = self.store.checksum[lease.slots]
                response = pb.LoadResponse(block_count=count, checksums=checksum.encode(expected))

            with self.store.in_use(lease):
                with self.metrics.cuda_copy_seconds.labels("load").time():
                    sums = await self.gpu.load(registration, targets, pages, target.deadline_ns, meanwhile=prepare_answer)
                    bad = checksum.mismatched(sums, expected)
                    if answer_now is not None and not bad.any():
                        answer_now(response)  # the moment the bytes are seen in place
                self.metrics.cuda_copy_bytes.labels("load").inc(count * ns.block_bytes)
                if bad.any():  # (the lease still pins the blocks while their pool bytes are read again)
                    self.metrics.cuda_checksum_failures.inc(int(bad.sum()))
                    await self._drop_corrupt(lease, bad)
                    raise DataLoss(f"{int(bad.sum())} of {count} blocks failed their checksum after the copy; recompute them")
            late_ms = (time.monotonic_ns() - target.deadline_ns) / 1e6
            if target.deadline_ns and late_ms > 0:  # (the engine waits a while longer; it should not happen)
                log.warning("cuda_ipc load seen done after its deadline", extra={"session": session_id, "late_ms": late_ms})
            return response
        finally:
            with contextlib.suppress(NotFound):  # it expired during the copy: nothing left to release
                self.store.release(session_id, lease.id)

    async def _drop_corrupt(self, lease: Lease, bad: np.ndarray) -> None:
        """Of a load's blocks that failed their check after the copy (`bad`), those whose bytes in the
        pool fail it too leave both tiers, so the engine's next store of them replaces them. Their pool
        bytes are read again on a worker thread (the lease pins them). A block whose pool bytes are
        intact stays: the copy went wrong on the engine's side (its KV cache changed under the load,
        or two of its blocks share memory), and other engines still load it. A block the lease holds
        that meanwhile left the namespace (another block of that hash in its place) is not touched."""
        ns = lease.namespace
        suspects = [block for block, failed in zip(lease.blocks, bad.tolist(), strict=True) if failed]
        pages = decode_page_ids(b"".join(block.pages for block in suspects), ns.pages_per_block)
        stored = self.store.checksum[[block.slot for block in suspects]]
        view = self.pool.view
        actual = await asyncio.to_thread(
            lambda: np.array([checksum.block_checksums(view.read_blocks(p[np.newaxis], ns.block_bytes))[0] for p in pages])
        )
        corrupt = checksum.mismatched(actual, stored).tolist()
        hashes = [b.hash for b, failed in zip(suspects, corrupt, strict=True) if failed and ns.blocks.get(b.hash) is b]
        if len(hashes) < len(suspects):
            log.warning(
                "blocks failed their checksum on a load but are intact in the pool; kept",
                extra={"namespace": ns.id, "blocks": len(suspects) - len(hashes)},
            )
        if not hashes:
            return
        self.store.delete(ns, hashes)
        if self.fs is not None:
            self.fs.delete(ns.id, hashes)
        log.warning("blocks failed their checksum on a load; dropped", extra={"namespace": ns.id, "blocks": len(hashes)})

    def _load_inline(self, session_id: str, lease: Lease) -> pb.LoadResponse:
        ns = lease.namespace
        try:
            if len(lease.blocks) > inline_blocks_fitting(self.limits.max_message_bytes, ns.block_bytes):
                raise ResourceExhausted(
                    f"inline load of {len(lease.blocks) * ns.block_bytes} bytes exceeds the message limit of "
                    f"{self.limits.max_message_bytes} bytes; load fewer blocks per call or use TRANSPORT_SHM"
                )
            data = self.pool.view.read_blocks(decode_page_ids(lease.page_ids, ns.pages_per_block), ns.block_bytes)
            return pb.LoadResponse(block_count=len(lease.blocks), data=data.tobytes(), checksums=self._checksums(lease))
        finally:
            self.store.release(session_id, lease.id)

    @unary
    def Release(self, request: pb.ReleaseRequest, context) -> pb.ReleaseResponse:  # noqa: N802
        """Release every lease named that can be; then refuse the call for the first that could not."""
        session = self.sessions.get(request.session_id)
        lease_ids = [request.lease_id, *request.more_lease_ids] if request.lease_id else list(request.more_lease_ids)
        if len(lease_ids) > self.limits.max_batch_blocks:
            raise InvalidArgument(f"{len(lease_ids)} leases exceed the limit of {self.limits.max_batch_blocks} per call")
        refused: list[KVTierError] = []
        for lease_id in lease_ids:
            try:
                self.store.release(session.id, lease_id)
            except KVTierError as exc:
                refused.append(exc)
        if refused:
            first = refused[0]
            raise type(first)(f"{len(refused)} of {len(lease_ids)} leases not released (the others were): {first}")
        return pb.ReleaseResponse()

    @unary
    async def Reserve(self, request: pb.ReserveRequest, context) -> pb.ReserveResponse:  # noqa: N802
        session, ns = self._session_namespace(request.session_id, request.namespace)
        if request.transport == pb.TRANSPORT_CUDA_IPC:
            return await self._store_cuda(session, ns, request)
        result = await self._reserve(session.id, ns, self.store.split_hashes(ns, request.hashes))
        response = pb.ReserveResponse(status=result.statuses.tolist())
        if result.reservation is None:
            return response
        response.reservation_id = result.reservation.id
        response.page_ids = result.reservation.page_ids
        response.lease_ttl_ms = self.limits.lease_ttl_ms
        return self._sendable(response, partial(self.store.abort, session.id, result.reservation.id), context)

    async def _reserve(self, session_id: str, ns: Namespace, hashes: list[bytes]) -> ReserveResult:
        """Reserve pool pages for the hashes, and return once they are the reservation's alone: the fs
        tier copies the blocks it demotes out of their pages on a thread, while the pages already
        belong to the reservation that evicted them (`copies_landed`). Should the wait end otherwise
        (the caller's deadline, its session gone), the reservation is aborted."""
        result = self.store.reserve(session_id, ns, hashes)
        if self.fs is None or result.reservation is None:
            return result
        try:
            await self.fs.copies_landed(result.reservation.page_ids)
            self.store.renew(self.store.reservation(session_id, result.reservation.id))  # (its session did not end)
        except BaseException:
            with contextlib.suppress(KVTierError):  # (gone with its session already)
                self.store.abort(session_id, result.reservation.id)
            raise
        return result

    async def _store_cuda(self, session: Session, ns: Namespace, request: pb.ReserveRequest) -> pb.ReserveResponse:
        """Reserve, copy from the engine's GPU blocks, checksum and commit, in one call."""
        registration = self.gpu.registration(session.id, request.cuda_ipc.registration_id, ns.id)
        hashes = self.store.split_hashes(ns, request.hashes)
        device_blocks = np.asarray(request.cuda_ipc.device_block_ids, dtype=np.int64)
        if len(device_blocks) != len(hashes):
            raise InvalidArgument(f"{len(device_blocks)} device block ids for {len(hashes)} hashes")
        registration.check_blocks(device_blocks)
        ready_event = registration.ready_event(request.cuda_ipc.ready_event)
        result = await self._reserve(session.id, ns, hashes)
        response = pb.ReserveResponse(status=result.statuses.tolist())
        reservation = result.reservation
        if reservation is None:
            return response
        chosen = device_blocks[result.statuses == pb.BLOCK_STATUS_RESERVED]
        # none given: --lease-ttl (its reservation must not wait forever for a forward that never ends)
        deadline_ns = request.cuda_ipc.deadline_ns or time.monotonic_ns() + self.limits.lease_ttl_ms * 1_000_000
        try:
            with self.metrics.cuda_copy_seconds.labels("store").time(), self.store.in_use(reservation):
                pages = decode_page_ids(reservation.page_ids, ns.pages_per_block)
                sums = await self.gpu.store(registration, chosen, pages, ready_event, deadline_ns)
            self.metrics.cuda_copy_bytes.labels("store").inc(len(chosen) * ns.block_bytes)
            if registration.closing:  # the engine died during the copy: its last step may be half computed
                raise FailedPrecondition("the engine's session ended during the store; nothing was committed")
            if deadline_ns and time.monotonic_ns() > deadline_ns:  # the engine may have reused the blocks meanwhile
                raise DeadlineExceeded("the copy was seen ending after the call's deadline; nothing was committed")
        except BaseException:
            self.store.abort(session.id, reservation.id)
            raise
        response.committed_count = self._commit(session, reservation, sums)
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
        ns, count = reservation.namespace, len(reservation.blocks)
        given = None  # (none: the blocks keep no checksum, unless the daemon computes them from `data`)
        if request.checksums:
            if len(request.checksums) != 8 * count:
                raise InvalidArgument(f"checksums field has {len(request.checksums)} bytes; {count} blocks need {8 * count}")
            given = checksum.decode(request.checksums)
        if not request.data:
            return pb.CommitResponse(committed_count=self._commit(session, reservation, given))
        expected = count * ns.block_bytes
        if len(request.data) != expected:
            raise InvalidArgument(
                f"commit data has {len(request.data)} bytes; the reservation's {count} blocks "
                f"of {ns.block_bytes} bytes need exactly {expected}"
            )
        blocks = np.frombuffer(request.data, dtype=np.uint8).reshape(count, ns.block_bytes)
        sums = checksum.block_checksums(blocks)
        if given is not None and (bad := checksum.mismatched(sums, given)).any():
            raise DataLoss(f"{int(bad.sum())} of {count} blocks' data do not match the checksums given; nothing committed")
        self.pool.view.write_blocks(decode_page_ids(reservation.page_ids, ns.pages_per_block), blocks)
        return pb.CommitResponse(committed_count=self._commit(session, reservation, sums))

    def _commit(self, session: Session, reservation, sums: np.ndarray) -> int:
        committed = self.store.commit(session.id, reservation.id, sums)
        if self.fs is not None:
            self.fs.committed(reservation.namespace, reservation.blocks)
        session.counters.stored_blocks += committed
        session.counters.stored_bytes += committed * reservation.namespace.block_bytes
        return committed

    @unary
    def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:  # noqa: N802
        session = self.sessions.get(request.session_id)
        self.store.abort(session.id, request.reservation_id)
        return pb.AbortResponse()


def _nothing() -> None:
    pass


async def _drain(request_iterator) -> None:
    async for _ in request_iterator:
        pass


def _check_transport(transport: int) -> int:
    """Loads say how bytes come back: through the mapped pool, inside the response, or into GPU memory."""
    if transport not in (pb.TRANSPORT_SHM, pb.TRANSPORT_INLINE, pb.TRANSPORT_CUDA_IPC):
        raise InvalidArgument(f"transport must be TRANSPORT_SHM, TRANSPORT_INLINE or TRANSPORT_CUDA_IPC, got {transport}")
    return transport
