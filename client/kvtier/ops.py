"""Client operations written once, without I/O: each is a generator that yields `(rpc_name, request)`
and receives the response. The sync client drives them with blocking calls, the asyncio client with
awaits, so both share every line of request building, validation and pool copying.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass, field

import numpy as np

from kvtier import checksum
from kvtier.pool_view import PoolMapping, decode_page_ids
from kvtier.v1 import kvtier_pb2 as pb

Op = Generator[tuple[str, object], object, object]  # yields (method, request), is sent the response, or
# thrown the call's error (an op may catch it to clean up, as a store aborts its reservation)
INLINE_OVERHEAD_BYTES = 64 << 10  # room left in an inline Commit beside its blocks' bytes
BATCH_QUERIES_FACTOR = 16  # a LookupBatch holds up to this many times max_batch_blocks hashes in all

TRANSPORTS = {"shm": pb.TRANSPORT_SHM, "inline": pb.TRANSPORT_INLINE}


def inline_blocks_fitting(max_message_bytes: int, block_bytes: int) -> int:
    """The most blocks whose bytes and checksums (8 bytes each) fit one message, beside the rest of it
    (INLINE_OVERHEAD_BYTES): an inline Commit's, or an inline Load's answer."""
    return (max_message_bytes - INLINE_OVERHEAD_BYTES) // (block_bytes + 8)


@dataclass(frozen=True)
class Namespace:
    """A registered namespace: its id and the geometry calls are checked against."""

    id: str
    spec: pb.NamespaceSpec
    block_bytes: int
    pages_per_block: int
    cuda_registration: str = ""  # set when the daemon accepted the session's GPU KV cache (TRANSPORT_CUDA_IPC)
    cuda_refused: str = ""  # why it did not

    @property
    def hash_bytes(self) -> int:
        return self.spec.hash_bytes


@dataclass
class LookupResult:
    hit_count: int
    lease_id: int = 0
    page_ids: np.ndarray = field(default_factory=lambda: np.empty((0, 0), dtype=np.uint32))
    checksums: np.ndarray = field(default_factory=lambda: np.empty(0, dtype=np.uint64))


def verified_prefix(blocks: np.ndarray, expected: np.ndarray) -> int:
    """How many leading blocks match their stored checksums (0 = unknown counts as a match)."""
    if len(blocks) == 0:
        return 0
    bad = checksum.mismatched(checksum.block_checksums(blocks), expected)
    return int(np.argmax(bad)) if bad.any() else len(blocks)


@dataclass
class Reservation:
    id: int
    statuses: np.ndarray  # pb.BlockStatus per hash
    page_ids: np.ndarray  # [reserved, pages_per_block]

    @property
    def reserved_indices(self) -> np.ndarray:
        return np.flatnonzero(self.statuses == pb.BLOCK_STATUS_RESERVED)


@dataclass
class SessionState:
    """What an open session knows: its id and the pool it maps for the shm transport."""

    session_id: str = ""
    pool_info: pb.PoolInfo | None = None
    limits: pb.Limits | None = None
    _mapping: PoolMapping | None = None
    _mapped_pool_id: str = ""

    def max_inline_blocks(self, block_bytes: int) -> int:
        """inline_blocks_fitting the daemon's message limit (at least one: a larger block is the
        daemon's to refuse)."""
        limit = self.limits.max_message_bytes if self.limits is not None and self.limits.max_message_bytes else 64 << 20
        return max(1, inline_blocks_fitting(limit, block_bytes))

    @property
    def max_batch_blocks(self) -> int:
        """The most block hashes the daemon takes in one call (its default before a session)."""
        return self.limits.max_batch_blocks if self.limits is not None and self.limits.max_batch_blocks else 4096

    def pool(self) -> PoolMapping:
        if self.pool_info is None:
            raise ConnectionError("no session: connect first")
        if self._mapping is None or self._mapped_pool_id != self.pool_info.pool_id:
            self.close_pool()
            info = self.pool_info
            self._mapping = PoolMapping(info.shm_path, info.size_bytes, info.page_size)
            self._mapped_pool_id = info.pool_id
        return self._mapping

    def close_pool(self) -> None:
        if self._mapping is not None:
            self._mapping.close()
            self._mapping = None


def join_hashes(hashes: Sequence[bytes] | bytes) -> bytes:
    return hashes if isinstance(hashes, (bytes, bytearray)) else b"".join(hashes)


def register(state: SessionState, spec: pb.NamespaceSpec, cuda_kv: pb.CudaKVCache | None = None, replaces: str = "") -> Op:
    """Register `spec`'s namespace (and offer `cuda_kv`); `replaces`: a namespace the session leaves."""
    request = pb.RegisterRequest(
        session_id=state.session_id, spec=spec, cuda_kv=cuda_kv, monotonic_ns=time.monotonic_ns(), replaces=replaces
    )
    response = yield "Register", request
    page_size = state.pool_info.page_size if state.pool_info is not None else 0
    if response.block_bytes != spec.block_bytes or (page_size and response.pages_per_block != -(-spec.block_bytes // page_size)):
        raise ValueError(f"kvtierd answered Register with {response.block_bytes}-byte blocks of {response.pages_per_block} pages")
    return Namespace(
        response.namespace,
        spec,
        response.block_bytes,
        response.pages_per_block,
        response.cuda_registration,
        response.cuda_refused,
    )


def _lookup_result(state: SessionState, response: pb.LookupResponse, ns: Namespace) -> LookupResult:
    if not response.lease_id:
        return LookupResult(response.hit_count)
    page_ids = _page_rows(state, response.page_ids, ns, response.hit_count)
    return LookupResult(response.hit_count, response.lease_id, page_ids, _block_checksums(response.checksums, response.hit_count))


def _page_rows(state: SessionState, page_ids: bytes, ns: Namespace, blocks: int) -> np.ndarray:
    """An answer's page ids, a row per block, every one within the pool (ValueError otherwise: an
    answer not to act on)."""
    rows = decode_page_ids(page_ids, ns.pages_per_block)
    info = state.pool_info
    pages = info.size_bytes // info.page_size if info is not None and info.page_size else 0
    if len(rows) != blocks or (rows.size and pages and int(rows.max()) >= pages):
        raise ValueError(f"kvtierd answered {len(rows)} blocks' pages (up to page {rows.max(initial=0)}) for {blocks} blocks")
    return rows


def _block_checksums(data: bytes, blocks: int) -> np.ndarray:
    sums = checksum.decode(data)
    if len(sums) != blocks:
        raise ValueError(f"kvtierd answered {len(sums)} checksums for {blocks} blocks")
    return sums


def lookup(state: SessionState, ns: Namespace, hashes, pin: bool = False) -> Op:
    request = pb.LookupRequest(session_id=state.session_id, namespace=ns.id, hashes=join_hashes(hashes), pin=pin)
    response = yield "Lookup", request
    return _lookup_result(state, response, ns)


def lookup_batch(state: SessionState, ns: Namespace, queries: Sequence[Sequence[bytes] | bytes], pin: bool = False) -> Op:
    """Independent prefix lookups; one LookupResult per query, each query cut to the daemon's
    max_batch_blocks hashes (its hit is then at most that many blocks). Unpinned, in as few calls
    of max_batch_blocks hashes in all as that takes; pinned, in one call of up to
    BATCH_QUERIES_FACTOR times that (it pins all its queries or none: a later call failing would
    leave the earlier calls' leases unknown to the caller)."""
    limit = state.max_batch_blocks
    cut = [join_hashes(q)[: limit * ns.hash_bytes] for q in queries]
    per_call = BATCH_QUERIES_FACTOR * limit if pin else limit
    batches: list[list[bytes]] = [[]]
    hashes = 0
    for query in cut:
        count = len(query) // ns.hash_bytes
        if len(batches[-1]) == limit or hashes + count > per_call:
            batches.append([])
            hashes = 0
        batches[-1].append(query)
        hashes += count
    if pin and len(batches) > 1:
        raise ValueError(f"a pinned lookup_batch takes at most {limit} queries and {per_call} hashes in all")
    results: list[LookupResult] = []
    for batch in batches:
        request = pb.LookupBatchRequest(session_id=state.session_id, namespace=ns.id, queries=batch, pin=pin)
        response = yield "LookupBatch", request
        results.extend(_lookup_result(state, r, ns) for r in response.results)
    return results


def release(state: SessionState, *lease_ids: int) -> Op:
    yield "Release", pb.ReleaseRequest(session_id=state.session_id, more_lease_ids=lease_ids)


def split_hashes(state: SessionState, ns: Namespace, hashes, most: int = 0) -> list[bytes]:
    """`hashes` in runs of at most the daemon's max_batch_blocks (a call over it is refused), or of
    `most` when fewer."""
    joined, step = join_hashes(hashes), min(state.max_batch_blocks, most or state.max_batch_blocks) * ns.hash_bytes
    return [joined[i : i + step] for i in range(0, len(joined), step)] or [b""]


def load(state: SessionState, ns: Namespace, hashes=b"", lease_id: int = 0, transport: str = "shm") -> Op:
    """Bytes of the leading present blocks as a [n, block_bytes] uint8 array (a copy). The prefix ends
    before the first block whose bytes do not match their stored checksum (a corrupt block is a miss).
    Many hashes go in several calls (max_batch_blocks; inline, as many blocks as one answer holds), the
    next only if the one before loaded all."""
    if lease_id:
        return (yield from _load(state, ns, b"", lease_id, transport))
    loaded = []
    most = state.max_inline_blocks(ns.block_bytes) if transport == "inline" else 0
    for run in split_hashes(state, ns, hashes, most):
        blocks = yield from _load(state, ns, run, 0, transport)
        loaded.append(blocks)
        if len(blocks) < len(run) // ns.hash_bytes:
            break
    return np.concatenate(loaded) if len(loaded) > 1 else loaded[0]


def _load(state: SessionState, ns: Namespace, hashes: bytes, lease_id: int, transport: str) -> Op:
    request = pb.LoadRequest(
        session_id=state.session_id,
        namespace=ns.id,
        hashes=join_hashes(hashes),
        lease_id=lease_id,
        transport=TRANSPORTS[transport],
    )
    response = yield "Load", request
    if transport == "inline":
        blocks = np.frombuffer(response.data, dtype=np.uint8).reshape(response.block_count, ns.block_bytes)
    elif response.block_count == 0:
        return np.empty((0, ns.block_bytes), dtype=np.uint8)
    else:
        try:
            pages = _page_rows(state, response.page_ids, ns, response.block_count)
            blocks = state.pool().view.read_blocks(pages, ns.block_bytes)
        finally:
            yield "Release", pb.ReleaseRequest(session_id=state.session_id, lease_id=response.lease_id)
    return blocks[: verified_prefix(blocks, _block_checksums(response.checksums, response.block_count))]


def _load_cuda(  # noqa: PLR0913
    state: SessionState, ns: Namespace, device_block_ids: Sequence[int], hashes=b"", lease_id: int = 0, deadline_ns: int = 0
) -> Op:
    """One Load call: the daemon copies the leading present blocks into the engine's GPU blocks `device_block_ids`
    (in order) and checks them; returns how many. A checksum failure raises grpc DATA_LOSS; a copy
    that could not end by `deadline_ns` (CLOCK_MONOTONIC, 0: none) is not started (DEADLINE_EXCEEDED)."""
    target = pb.CudaIpcTarget(registration_id=ns.cuda_registration, device_block_ids=device_block_ids, deadline_ns=deadline_ns)
    request = pb.LoadRequest(
        session_id=state.session_id,
        namespace=ns.id,
        hashes=join_hashes(hashes),
        lease_id=lease_id,
        transport=pb.TRANSPORT_CUDA_IPC,
        cuda_ipc=target,
    )
    response = yield "Load", request
    return response.block_count


def load_cuda(  # noqa: PLR0913
    state: SessionState, ns: Namespace, device_block_ids: Sequence[int], hashes=b"", lease_id: int = 0, deadline_ns: int = 0
) -> Op:
    """_load_cuda in calls of at most max_batch_blocks blocks, the next only if the one before
    loaded all (a lease is loaded in one call); how many blocks were loaded."""
    if lease_id:
        return (yield from _load_cuda(state, ns, device_block_ids, b"", lease_id, deadline_ns))
    loaded = 0
    for run, targets in _device_runs(state, ns, hashes, device_block_ids):
        count = yield from _load_cuda(state, ns, targets, run, 0, deadline_ns)
        loaded += count
        if count < len(targets):
            break
    return loaded


def store_cuda(  # noqa: PLR0913
    state: SessionState,
    ns: Namespace,
    hashes: Sequence[bytes],
    device_block_ids: Sequence[int],
    ready_event: int,
    deadline_ns: int = 0,
) -> Op:
    """The daemon copies the engine's GPU blocks into the pool (once the engine's ready event
    `ready_event`, an index into its ring, has completed) and commits them, in Reserve calls of at
    most max_batch_blocks blocks; returns how many were newly committed. Nothing is committed from
    a copy seen ending after `deadline_ns` (DEADLINE_EXCEEDED)."""
    committed = 0
    for run, targets in _device_runs(state, ns, hashes, device_block_ids):
        target = pb.CudaIpcTarget(
            registration_id=ns.cuda_registration, device_block_ids=targets, deadline_ns=deadline_ns, ready_event=ready_event
        )
        request = pb.ReserveRequest(
            session_id=state.session_id, namespace=ns.id, hashes=run, transport=pb.TRANSPORT_CUDA_IPC, cuda_ipc=target
        )
        response = yield "Reserve", request
        committed += response.committed_count
    return committed


def _device_runs(state: SessionState, ns: Namespace, hashes, device_block_ids: Sequence[int]):
    """(hashes, device block ids) in runs of at most max_batch_blocks."""
    limit = state.max_batch_blocks
    for index, run in enumerate(split_hashes(state, ns, hashes)):
        yield run, device_block_ids[index * limit : index * limit + len(run) // ns.hash_bytes]


def reserve(state: SessionState, ns: Namespace, hashes) -> Op:
    response = yield "Reserve", pb.ReserveRequest(session_id=state.session_id, namespace=ns.id, hashes=join_hashes(hashes))
    page_ids = decode_page_ids(response.page_ids, ns.pages_per_block)
    return Reservation(response.reservation_id, np.asarray(response.status, dtype=np.uint8), page_ids)


def write(state: SessionState, reservation_id: int, index: int, offset: int, data: bytes) -> Op:
    request = pb.WriteRequest(session_id=state.session_id, reservation_id=reservation_id, index=index, offset=offset, data=data)
    yield "Write", request


def commit(state: SessionState, reservation_id: int, data: bytes = b"", checksums: np.ndarray | None = None) -> Op:
    sums = b"" if checksums is None else checksum.encode(checksums)
    request = pb.CommitRequest(session_id=state.session_id, reservation_id=reservation_id, data=data, checksums=sums)
    response = yield "Commit", request
    return response.committed_count


def abort(state: SessionState, reservation_id: int) -> Op:
    yield "Abort", pb.AbortRequest(session_id=state.session_id, reservation_id=reservation_id)


def store(state: SessionState, ns: Namespace, hashes: Sequence[bytes], data: np.ndarray, transport: str = "shm") -> Op:
    """Store blocks `data` [n, block_bytes] under `hashes`; returns how many were newly committed.
    Many blocks go in several reservations of at most max_batch_blocks."""
    if data.shape != (len(hashes), ns.block_bytes):
        raise ValueError(f"data shape {data.shape} does not match {len(hashes)} blocks of {ns.block_bytes} bytes")
    committed, limit = 0, state.max_batch_blocks
    if transport == "inline":  # (each Commit carries its blocks' bytes)
        limit = min(limit, state.max_inline_blocks(ns.block_bytes))
    for start in range(0, len(hashes), limit):
        committed += yield from _store(state, ns, hashes[start : start + limit], data[start : start + limit], transport)
    return committed


def _store(state: SessionState, ns: Namespace, hashes: Sequence[bytes], data: np.ndarray, transport: str) -> Op:
    reservation = yield from reserve(state, ns, hashes)
    if not reservation.id:
        return 0
    chosen = data[reservation.reserved_indices]
    try:
        if transport == "inline":
            return (yield from commit(state, reservation.id, np.ascontiguousarray(chosen).tobytes()))
        state.pool().view.write_blocks(reservation.page_ids, chosen)
        return (yield from commit(state, reservation.id, checksums=checksum.block_checksums(chosen)))
    except Exception:  # (a failed write or Commit: the blocks are not left "being written" until --lease-ttl)
        with contextlib.suppress(Exception):  # (ended already: committed after all, or with the session)
            yield from abort(state, reservation.id)
        raise
