"""The RAM tier's index: namespaces, blocks, two-phase stores, pin leases, eviction and admission.

Pure bookkeeping over page ids: no I/O, no gRPC, no locks (the daemon calls it from one event loop).
Invariants: an uncommitted block is never visible to lookups; a pinned or reserved block is never
evicted; every page is either free or owned by exactly one live block.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Iterator

import numpy as np
from kvtier.v1 import kvtier_pb2 as pb

from kvtierd.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    OutOfRange,
    PermissionDenied,
    ResourceExhausted,
)
from kvtierd.eviction import make_policy
from kvtierd.namespace import namespace_digest, validate_spec
from kvtierd.page_allocator import PageAllocator

RAM_TIER = "ram"
_ADMISSION_MEMORY = 1 << 20  # offers remembered for --store-threshold
_ENDED_MEMORY = 1 << 14  # finished reservation ids remembered to explain double commits


@dataclass
class TierCounters:
    lookups: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    stored_blocks: int = 0
    loaded_blocks: int = 0
    not_admitted: int = 0


@dataclass(eq=False)
class Namespace:
    id: str
    spec: pb.NamespaceSpec
    block_bytes: int
    pages_per_block: int
    created_at: float
    blocks: dict[bytes, "Block"] = field(default_factory=dict)  # committed and reserved
    committed_blocks: int = 0
    counters: TierCounters = field(default_factory=TierCounters)

    @property
    def hash_bytes(self) -> int:
        return self.spec.hash_bytes


@dataclass(slots=True, eq=False)
class Block:
    namespace: Namespace
    hash: bytes
    pages: bytes  # little-endian uint32 page ids
    committed: bool = False
    deleted: bool = False
    pins: int = 0
    hits: int = 0
    created_at: float = 0.0
    last_access: float = 0.0

    @property
    def key(self) -> tuple[str, bytes]:
        return (self.namespace.id, self.hash)


@dataclass(eq=False)
class Lease:
    """Blocks pinned for a load; released by Release, by its session ending, or on expiry."""

    id: int
    session_id: str
    namespace: Namespace
    blocks: list[Block]
    expires_at: float

    @property
    def page_ids(self) -> bytes:
        return b"".join(b.pages for b in self.blocks)


@dataclass(eq=False)
class Reservation:
    """Blocks being written; visible only after commit."""

    id: int
    session_id: str
    namespace: Namespace
    blocks: list[Block]
    expires_at: float

    @property
    def page_ids(self) -> bytes:
        return b"".join(b.pages for b in self.blocks)


@dataclass
class ReserveResult:
    reservation: Reservation | None
    statuses: np.ndarray  # uint8 pb.BlockStatus per hash


@dataclass
class PoolUsage:
    total_pages: int
    used_pages: int
    committed_pages: int
    reserved_pages: int
    orphan_pages: int  # deleted or evicted but still pinned by a lease
    pinned_blocks: int


class BlockStore:
    def __init__(
        self,
        num_pages: int,
        page_size: int,
        eviction: str = "lru",
        store_threshold: int = 1,
        lease_ttl: float = 30.0,
        max_namespaces: int = 64,
        max_batch_blocks: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages)
        self.policy = make_policy(eviction)
        self.store_threshold = store_threshold
        self.lease_ttl = lease_ttl
        self.max_namespaces = max_namespaces
        self.max_batch_blocks = max_batch_blocks
        self._clock = clock
        self.namespaces: dict[str, Namespace] = {}
        self._leases: dict[int, Lease] = {}
        self._reservations: dict[int, Reservation] = {}
        self._ended: OrderedDict[int, str] = OrderedDict()
        self._offers: OrderedDict[tuple[str, bytes], int] = OrderedDict()
        self._ids = itertools.count(1)
        self._reserved_pages = 0
        self._orphan_pages = 0

    @property
    def capacity_bytes(self) -> int:
        return self.allocator.num_pages * self.page_size

    # ------------------------------------------------------------------ namespaces

    def register(self, spec: pb.NamespaceSpec) -> Namespace:
        validate_spec(spec, self.capacity_bytes)
        digest = namespace_digest(spec)
        existing = self.namespaces.get(digest)
        if existing is not None:
            return existing
        if len(self.namespaces) >= self.max_namespaces:
            raise ResourceExhausted(f"namespace limit reached ({self.max_namespaces}); raise --max-namespaces")
        ns = Namespace(
            id=digest,
            spec=spec,
            block_bytes=spec.block_bytes,
            pages_per_block=-(-spec.block_bytes // self.page_size),
            created_at=time.time(),
        )
        self.namespaces[digest] = ns
        return ns

    def namespace(self, namespace_id: str) -> Namespace:
        ns = self.namespaces.get(namespace_id)
        if ns is None:
            raise NotFound(f"unknown namespace {namespace_id!r}; call Register first")
        return ns

    def split_hashes(self, ns: Namespace, hashes: bytes) -> list[bytes]:
        size = ns.hash_bytes
        if len(hashes) % size:
            raise InvalidArgument(
                f"hashes field has {len(hashes)} bytes, not a multiple of the namespace's hash_bytes {size}"
            )
        count = len(hashes) // size
        if count > self.max_batch_blocks:
            raise InvalidArgument(f"batch of {count} blocks exceeds the limit of {self.max_batch_blocks} (--max-batch-blocks)")
        return [hashes[i : i + size] for i in range(0, len(hashes), size)]

    # ------------------------------------------------------------------ lookup and load

    def lookup(self, session_id: str, ns: Namespace, hashes: list[bytes], pin: bool) -> tuple[int, Lease | None]:
        """Count the leading hashes that are committed; with `pin`, pin them under a new lease."""
        blocks = ns.blocks
        hit: list[Block] = []
        for h in hashes:
            block = blocks.get(h)
            if block is None or not block.committed:
                break
            hit.append(block)
        now = time.time()
        counters = ns.counters
        counters.lookups += 1
        counters.hits += len(hit)
        counters.misses += len(hashes) - len(hit)
        for block in hit:
            block.hits += 1
            block.last_access = now
            if pin:
                self._pin(block)
            else:
                self.policy.access(block)
        if not (pin and hit):
            return len(hit), None
        lease = Lease(next(self._ids), session_id, ns, hit, self._clock() + self.lease_ttl)
        self._leases[lease.id] = lease
        return len(hit), lease

    def lease(self, session_id: str, lease_id: int) -> Lease:
        lease = self._leases.get(lease_id)
        if lease is None:
            raise NotFound(f"lease {lease_id} is unknown, released or expired")
        if lease.session_id != session_id:
            raise PermissionDenied(f"lease {lease_id} belongs to another session")
        return lease

    def release(self, session_id: str, lease_id: int) -> None:
        self._end_lease(self.lease(session_id, lease_id))

    def note_loaded(self, lease: Lease) -> None:
        lease.namespace.counters.loaded_blocks += len(lease.blocks)

    def _end_lease(self, lease: Lease) -> None:
        del self._leases[lease.id]
        for block in lease.blocks:
            self._unpin(block)

    def _pin(self, block: Block) -> None:
        if block.pins == 0:
            self.policy.remove(block)
        block.pins += 1

    def _unpin(self, block: Block) -> None:
        block.pins -= 1
        if block.pins:
            return
        if block.deleted:
            self._orphan_pages -= block.namespace.pages_per_block
            self._free(block)
        else:
            self.policy.restore(block)

    # ------------------------------------------------------------------ two-phase store

    def reserve(self, session_id: str, ns: Namespace, hashes: list[bytes]) -> ReserveResult:
        statuses = np.full(len(hashes), pb.BLOCK_STATUS_RESERVED, dtype=np.uint8)
        wanted: list[int] = []
        pending: set[bytes] = set()
        for i, h in enumerate(hashes):
            block = ns.blocks.get(h)
            if block is not None:
                statuses[i] = pb.BLOCK_STATUS_PRESENT if block.committed else pb.BLOCK_STATUS_IN_PROGRESS
            elif h in pending:
                statuses[i] = pb.BLOCK_STATUS_IN_PROGRESS
            elif not self._admit(ns, h):
                statuses[i] = pb.BLOCK_STATUS_NOT_ADMITTED
            else:
                pending.add(h)
                wanted.append(i)
        ppb = ns.pages_per_block
        self._make_room(len(wanted) * ppb)
        fit = min(len(wanted), self.allocator.free_pages // ppb)
        statuses[wanted[fit:]] = pb.BLOCK_STATUS_NO_SPACE
        if fit == 0:
            return ReserveResult(None, statuses)
        pages = self.allocator.allocate(fit * ppb)
        assert pages is not None
        page_bytes = pages.astype("<u4").tobytes()
        step = ppb * 4
        reserved = []
        for j, i in enumerate(wanted[:fit]):
            block = Block(ns, hashes[i], page_bytes[j * step : (j + 1) * step])
            ns.blocks[block.hash] = block
            reserved.append(block)
        self._reserved_pages += fit * ppb
        reservation = Reservation(next(self._ids), session_id, ns, reserved, self._clock() + self.lease_ttl)
        self._reservations[reservation.id] = reservation
        return ReserveResult(reservation, statuses)

    def reservation(self, session_id: str, reservation_id: int) -> Reservation:
        reservation = self._reservations.get(reservation_id)
        if reservation is None:
            ended = self._ended.get(reservation_id)
            if ended is not None:
                raise FailedPrecondition(f"reservation {reservation_id} was already {ended}")
            raise NotFound(f"reservation {reservation_id} was never made")
        if reservation.session_id != session_id:
            raise PermissionDenied(f"reservation {reservation_id} belongs to another session")
        return reservation

    def check_write(self, reservation: Reservation, index: int, offset: int, length: int) -> Block:
        if index >= len(reservation.blocks):
            raise OutOfRange(f"block index {index} outside reservation of {len(reservation.blocks)} blocks")
        if offset + length > reservation.namespace.block_bytes:
            raise OutOfRange(
                f"write of {length} bytes at offset {offset} ends beyond the block's "
                f"{reservation.namespace.block_bytes} bytes"
            )
        return reservation.blocks[index]

    def commit(self, session_id: str, reservation_id: int) -> int:
        reservation = self.reservation(session_id, reservation_id)
        self._end_reservation(reservation, "committed")
        now = time.time()
        ns = reservation.namespace
        committed = 0
        for block in reservation.blocks:
            if block.deleted:
                self._free(block)
                continue
            block.committed = True
            block.created_at = block.last_access = now
            self.policy.insert(block)
            committed += 1
        ns.committed_blocks += committed
        ns.counters.stored_blocks += committed
        return committed

    def abort(self, session_id: str, reservation_id: int) -> None:
        self._abort(self.reservation(session_id, reservation_id), "aborted")

    def _abort(self, reservation: Reservation, how: str) -> None:
        self._end_reservation(reservation, how)
        for block in reservation.blocks:
            if not block.deleted:
                del reservation.namespace.blocks[block.hash]
            self._free(block)

    def _end_reservation(self, reservation: Reservation, how: str) -> None:
        del self._reservations[reservation.id]
        self._reserved_pages -= len(reservation.blocks) * reservation.namespace.pages_per_block
        self._ended[reservation.id] = how
        if len(self._ended) > _ENDED_MEMORY:
            self._ended.popitem(last=False)

    def _admit(self, ns: Namespace, block_hash: bytes) -> bool:
        if self.store_threshold <= 1:
            return True
        key = (ns.id, block_hash)
        offers = self._offers.pop(key, 0) + 1
        if offers >= self.store_threshold:
            return True
        self._offers[key] = offers
        if len(self._offers) > _ADMISSION_MEMORY:
            self._offers.popitem(last=False)
        ns.counters.not_admitted += 1
        return False

    # ------------------------------------------------------------------ eviction and deletion

    def _make_room(self, pages: int) -> None:
        while self.allocator.free_pages < pages:
            victim = self.policy.pop_victim()
            if victim is None:
                return
            victim.namespace.counters.evictions += 1
            self._drop(victim)

    def _drop(self, block: Block) -> None:
        """Make a block invisible now; its pages go back once no lease or reservation holds them."""
        ns = block.namespace
        if ns.blocks.get(block.hash) is block:
            del ns.blocks[block.hash]
        if block.deleted:
            return
        block.deleted = True
        if not block.committed:
            return  # its reservation frees the pages when it ends
        ns.committed_blocks -= 1
        self.policy.remove(block)
        if block.pins:
            self._orphan_pages += ns.pages_per_block
        else:
            self._free(block)

    def _free(self, block: Block) -> None:
        self.allocator.release(np.frombuffer(block.pages, dtype="<u4"))

    def delete(self, ns: Namespace, hashes: list[bytes]) -> int:
        victims = [b for b in (ns.blocks.get(h) for h in hashes) if b is not None and b.committed]
        for block in victims:
            self._drop(block)
        return len(victims)

    def clear(self, ns: Namespace | None) -> int:
        targets = [ns] if ns is not None else list(self.namespaces.values())
        deleted = 0
        for target in targets:
            for block in list(target.blocks.values()):
                deleted += block.committed
                self._drop(block)
        return deleted

    # ------------------------------------------------------------------ sessions and expiry

    def drop_session(self, session_id: str) -> tuple[int, int]:
        """Release everything a session holds; returns (leases, reservations) released."""
        leases = [lease for lease in self._leases.values() if lease.session_id == session_id]
        reservations = [r for r in self._reservations.values() if r.session_id == session_id]
        for lease in leases:
            self._end_lease(lease)
        for reservation in reservations:
            self._abort(reservation, "aborted (session ended)")
        return len(leases), len(reservations)

    def expire(self) -> tuple[int, int]:
        now = self._clock()
        leases = [lease for lease in self._leases.values() if lease.expires_at <= now]
        reservations = [r for r in self._reservations.values() if r.expires_at <= now]
        for lease in leases:
            self._end_lease(lease)
        for reservation in reservations:
            self._abort(reservation, "expired")
        return len(leases), len(reservations)

    # ------------------------------------------------------------------ inspection

    def usage(self) -> PoolUsage:
        committed = sum(ns.committed_blocks * ns.pages_per_block for ns in self.namespaces.values())
        pinned = sum(1 for lease in self._leases.values() for _ in lease.blocks)
        return PoolUsage(
            total_pages=self.allocator.num_pages,
            used_pages=self.allocator.used_pages,
            committed_pages=committed,
            reserved_pages=self._reserved_pages,
            orphan_pages=self._orphan_pages,
            pinned_blocks=pinned,
        )

    def committed_blocks(self, ns: Namespace | None = None) -> Iterator[Block]:
        targets = [ns] if ns is not None else self.namespaces.values()
        for target in targets:
            for block in target.blocks.values():
                if block.committed:
                    yield block

    def find_block(self, ns: Namespace, block_hash: bytes) -> Block:
        block = ns.blocks.get(block_hash)
        if block is None or not block.committed:
            raise NotFound(f"block {block_hash.hex()} is not in namespace {ns.id}")
        return block
