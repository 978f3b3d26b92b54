"""The RAM tier's index: namespaces, blocks, two-phase stores, pin leases, eviction and admission.

Pure bookkeeping over page ids: no I/O, no gRPC, no locks (the daemon calls it from one event loop;
only `census` is shared with metrics scrapes).
Per-block numbers (state, pins, hits, times) live in numpy arrays indexed by a block's slot, so the hot
paths (lookup, pin, release, commit) update whole batches at once; dict probes and policy updates run
through `map` in C rather than Python loops.

Invariants: an uncommitted block is never visible to lookups; a pinned or reserved block is never
evicted; every page is either free or owned by exactly one block that still holds it.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from operator import attrgetter

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
from kvtierd.id_allocator import IdAllocator
from kvtierd.namespace import namespace_digest, validate_spec

log = logging.getLogger("kvtierd.store")

RAM_TIER = "ram"
_ADMISSION_MEMORY = 1 << 20  # offers remembered for --store-threshold
_ENDED_MEMORY = 1 << 14  # finished reservation ids remembered to explain double commits

# Slot states
FREE, RESERVED, COMMITTED, DROPPED = 0, 1, 2, 3  # DROPPED: invisible, pages still held by a lease or reservation

_slot_of = attrgetter("slot")
_hash_of = attrgetter("hash")


def _consume(iterator) -> None:
    deque(iterator, maxlen=0)


@dataclass
class TierCounters:
    lookups: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    stored_blocks: int = 0
    loaded_blocks: int = 0
    not_admitted: int = 0

    def add(self, other: TierCounters, times: int = 1) -> None:
        """Add `other`'s counts, each `times` over (`times` a block size: their bytes)."""
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name) * times)


@dataclass(eq=False)
class Namespace:
    id: str
    spec: pb.NamespaceSpec
    block_bytes: int
    pages_per_block: int
    created_at: float
    last_used: float = 0.0  # (the store's clock) when last registered, looked up or stored into
    blocks: dict[bytes, Block] = field(default_factory=dict)  # committed
    pending: dict[bytes, Block] = field(default_factory=dict)  # reserved, not yet committed
    counters: TierCounters = field(default_factory=TierCounters)

    @property
    def hash_bytes(self) -> int:
        return self.spec.hash_bytes


@dataclass(slots=True, eq=False)
class Block:
    namespace: Namespace
    hash: bytes
    pages: bytes  # little-endian uint32 page ids
    slot: int


@dataclass(eq=False)
class Hold:
    """Blocks held by one session: pinned for a load (a lease) or being written (a reservation)."""

    id: int
    session_id: str
    namespace: Namespace
    blocks: list[Block]
    expires_at: float
    copies: int = 0  # GPU copies in flight between its pages and an engine (BlockStore.in_use)

    @property
    def slots(self) -> np.ndarray:
        return np.fromiter(map(_slot_of, self.blocks), dtype=np.int64, count=len(self.blocks))

    @property
    def page_ids(self) -> bytes:
        return b"".join(b.pages for b in self.blocks)


Lease = Hold
Reservation = Hold


@dataclass
class ReserveResult:
    reservation: Reservation | None
    statuses: np.ndarray  # uint8 pb.BlockStatus per hash


@dataclass
class PoolUsage:
    used_pages: int
    committed_pages: int
    reserved_pages: int
    orphan_pages: int  # deleted or evicted but still pinned by a lease
    pinned_blocks: int


def _check_idle(hold: Hold, kind: str) -> None:
    if hold.copies:
        raise FailedPrecondition(
            f"{kind} {hold.id} is in use by a GPU copy in flight (a call of its session); it is free once that call answers"
        )


def until_repeat(hashes: list[bytes]) -> list[bytes]:
    """A prefix chain never repeats a hash; cut a batch at its first repeat so slots stay distinct."""
    if len(set(hashes)) == len(hashes):
        return hashes
    seen: set[bytes] = set()
    for i, h in enumerate(hashes):
        if h in seen:
            return hashes[:i]
        seen.add(h)
    raise AssertionError("unreachable")


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
        self.pages = IdAllocator(num_pages)
        self.slots = IdAllocator(num_pages)  # a block takes at least one page
        self.state = np.zeros(num_pages, dtype=np.uint8)
        self.pins = np.zeros(num_pages, dtype=np.int32)
        self.hits = np.zeros(num_pages, dtype=np.uint32)
        self.created_at = np.zeros(num_pages, dtype=np.float64)
        self.last_access = np.zeros(num_pages, dtype=np.float64)
        self.checksum = np.zeros(num_pages, dtype=np.uint64)
        self.block_at: list[Block | None] = [None] * num_pages
        self.policy = make_policy(eviction)
        self.store_threshold = store_threshold
        self.lease_ttl = lease_ttl
        self.max_namespaces = max_namespaces
        self.max_batch_blocks = max_batch_blocks
        self._clock = clock
        self.namespaces: dict[str, Namespace] = {}
        self.retired = TierCounters()  # of the namespaces retired so far (counters only go up)
        self.retired_bytes = TierCounters()  # the same in bytes (blocks times their namespace's block size)
        # Held while a retirement moves counters into `retired` and while a metrics scrape (another
        # thread) adds them up, which would otherwise see them in both places or in neither.
        self.census = threading.Lock()
        self._leases: dict[int, Lease] = {}
        self._reservations: dict[int, Reservation] = {}
        self._ended: OrderedDict[int, str] = OrderedDict()
        self._offers: OrderedDict[tuple[str, bytes], int] = OrderedDict()
        self._ids = itertools.count(1)
        self._reserved_pages = 0
        self._orphan_pages = 0
        self._pinned_pages = 0  # of blocks with pins (orphans included): not evictable
        # Called with the blocks about to be evicted, while their pages still hold their bytes (the
        # filesystem tier copies them out for demotion); the pages are reused as soon as it returns.
        self.on_evict: Callable[[list[Block]], None] | None = None

    @property
    def capacity_bytes(self) -> int:
        return self.pages.size * self.page_size

    # ------------------------------------------------------------------ namespaces

    def register(self, spec: pb.NamespaceSpec) -> Namespace:
        validate_spec(spec, self.capacity_bytes)
        digest = namespace_digest(spec)
        existing = self.namespaces.get(digest)
        if existing is not None:
            existing.last_used = self._clock()
            return existing
        if len(self.namespaces) >= self.max_namespaces:
            raise ResourceExhausted(
                f"namespace limit reached ({self.max_namespaces}), every namespace registered by a connected engine "
                "or held for a call; raise --max-namespaces"
            )
        ns = Namespace(
            id=digest,
            spec=spec,
            block_bytes=spec.block_bytes,
            pages_per_block=-(-spec.block_bytes // self.page_size),
            created_at=time.time(),
            last_used=self._clock(),
        )
        self.namespaces[digest] = ns
        return ns

    def _still_known(self, ns: Namespace) -> None:
        """Refuse to hold blocks for a namespace the store has retired: nothing would count or free them."""
        if self.namespaces.get(ns.id) is not ns:
            raise NotFound(f"namespace {ns.id} was retired")

    def holds_any(self, ns: Namespace) -> bool:
        """Some lease or reservation holds blocks of `ns`."""
        return any(hold.namespace is ns for hold in itertools.chain(self._leases.values(), self._reservations.values()))

    def retire(self, ns: Namespace) -> int:
        """Forget a namespace that nothing holds, with its blocks (their pages go free); its counters
        go on in `retired`. Returns the blocks deleted."""
        if self.holds_any(ns):
            raise FailedPrecondition(f"namespace {ns.id} is held by a lease or reservation")
        deleted = self.clear(ns)  # (none pending; one held during a promotion goes when the hold ends)
        with self.census:
            del self.namespaces[ns.id]
            self.retired.add(ns.counters)
            self.retired_bytes.add(ns.counters, ns.block_bytes)
        return deleted

    def namespace(self, namespace_id: str) -> Namespace:
        ns = self.namespaces.get(namespace_id)
        if ns is None:
            raise NotFound(f"unknown namespace {namespace_id!r}; call Register first")
        return ns

    def split_hashes(self, ns: Namespace, hashes: bytes) -> list[bytes]:
        size = ns.hash_bytes
        if len(hashes) % size:
            raise InvalidArgument(f"hashes field has {len(hashes)} bytes, not a multiple of the namespace's hash_bytes {size}")
        count = len(hashes) // size
        if count > self.max_batch_blocks:
            raise InvalidArgument(f"batch of {count} blocks exceeds the limit of {self.max_batch_blocks} (--max-batch-blocks)")
        return np.frombuffer(hashes, dtype=f"V{size}").tolist()

    # ------------------------------------------------------------------ lookup and load

    def lookup(self, session_id: str, ns: Namespace, hashes: list[bytes], pin: bool) -> tuple[int, Lease | None]:
        """Count the leading hashes that are committed; with `pin`, pin them under a new lease."""
        if pin:  # a lease pins each block once
            self._still_known(ns)
            hashes = until_repeat(hashes)
        hit: list[Block] = list(itertools.takewhile(bool, map(ns.blocks.get, hashes)))
        ns.last_used = self._clock()
        counters = ns.counters
        counters.lookups += 1
        counters.hits += len(hit)
        counters.misses += len(hashes) - len(hit)
        if not hit:
            return 0, None
        slots = np.fromiter(map(_slot_of, hit), dtype=np.int64, count=len(hit))
        self.hits[slots] += 1
        self.last_access[slots] = time.time()
        if not pin:
            self.policy.access_many(slots[self.pins[slots] == 0].tolist())
            return len(hit), None
        self._pin(slots, ns.pages_per_block)
        lease = Lease(next(self._ids), session_id, ns, hit, self._clock() + self.lease_ttl)
        self._leases[lease.id] = lease
        return len(hit), lease

    def lease(self, session_id: str, lease_id: int) -> Lease:
        lease = self._leases.get(lease_id)
        if lease is None:
            raise NotFound(f"lease {lease_id} is unknown, released or expired")
        if lease.session_id != session_id:
            raise PermissionDenied(f"lease {lease_id} belongs to another session")
        _check_idle(lease, "lease")
        return lease

    @contextlib.contextmanager
    def in_use(self, hold: Hold) -> Iterator[None]:
        """A GPU copy moves bytes between the hold's pages and an engine meanwhile: until it has
        landed the hold neither expires nor can its session release, abort, commit or write it (its
        pages would go to other blocks while the copy still reads or writes them). The session's end
        waits for its copies first (GpuTransfers.close_session)."""
        hold.copies += 1
        try:
            yield
        finally:
            hold.copies -= 1

    @contextlib.contextmanager
    def held(self, ns: Namespace, hashes: list[bytes]) -> Iterator[None]:
        """Keep the committed blocks among `hashes` from eviction meanwhile: a prefix's blocks in the
        pool while its blocks on disk are promoted, whose room would otherwise be made by evicting them.
        They go back to the eviction policy as just used (they are in a prefix just looked up)."""
        blocks = [block for block in map(ns.blocks.get, dict.fromkeys(hashes)) if block is not None]
        slots = np.fromiter(map(_slot_of, blocks), dtype=np.int64, count=len(blocks))
        self._pin(slots, ns.pages_per_block)
        try:
            yield
        finally:
            self._unpin(slots, ns.pages_per_block)

    def release(self, session_id: str, lease_id: int) -> None:
        self._end_lease(self.lease(session_id, lease_id))

    def extend_lease(self, session_id: str, ns: Namespace, lease: Lease | None, hashes: list[bytes]) -> Lease | None:
        """Pin the leading committed blocks of `hashes` too (blocks just promoted from disk, following
        the prefix `lease` holds); returns the lease holding them all (a new one when `lease` is None)."""
        self._still_known(ns)
        if lease is not None and self._leases.get(lease.id) is not lease:
            raise NotFound(f"lease {lease.id} ended while blocks were read from disk")
        held = {b.hash for b in lease.blocks} if lease is not None else set()
        more: list[Block] = list(itertools.takewhile(bool, map(ns.blocks.get, until_repeat(hashes))))
        cut = next((i for i, b in enumerate(more) if b.hash in held), len(more))
        more = more[:cut]
        if not more:
            return lease
        slots = np.fromiter(map(_slot_of, more), dtype=np.int64, count=len(more))
        self.hits[slots] += 1
        self.last_access[slots] = time.time()
        self._pin(slots, ns.pages_per_block)
        if lease is None:
            lease = Lease(next(self._ids), session_id, ns, [], self._clock() + self.lease_ttl)
            self._leases[lease.id] = lease
        lease.blocks.extend(more)
        return lease

    def renew(self, hold: Hold) -> None:
        """Start a lease's or reservation's time to live again (its holder was kept waiting)."""
        hold.expires_at = self._clock() + self.lease_ttl

    def note_loaded(self, ns: Namespace, blocks: int) -> None:
        ns.counters.loaded_blocks += blocks

    def _end_lease(self, lease: Lease) -> None:
        del self._leases[lease.id]
        self._unpin(lease.slots, lease.namespace.pages_per_block)  # distinct: lookups stop at a repeated hash

    def _unpin(self, slots: np.ndarray, pages_per_block: int) -> None:
        self.pins[slots] -= 1
        unpinned = slots[self.pins[slots] == 0]
        self._pinned_pages -= len(unpinned) * pages_per_block
        states = self.state[unpinned]
        self.policy.restore_many(unpinned[states == COMMITTED].tolist())
        for slot in unpinned[states == DROPPED].tolist():
            block = self.block_at[slot]
            self._orphan_pages -= block.namespace.pages_per_block
            self._free(block)

    def _pin(self, slots: np.ndarray, pages_per_block: int) -> None:
        """Pin blocks of one namespace (each once)."""
        newly = slots[self.pins[slots] == 0]
        self.policy.remove_many(newly.tolist(), forget=False)
        self._pinned_pages += len(newly) * pages_per_block
        self.pins[slots] += 1

    # ------------------------------------------------------------------ two-phase store

    def reserve(self, session_id: str, ns: Namespace, hashes: list[bytes], admit_all: bool = False) -> ReserveResult:
        """Reserve pages for the hashes not present; `admit_all` skips --store-threshold (promotions)."""
        self._still_known(ns)
        ns.last_used = self._clock()
        count = len(hashes)
        statuses = np.full(count, pb.BLOCK_STATUS_RESERVED, dtype=np.uint8)
        statuses[np.fromiter(map(ns.blocks.__contains__, hashes), dtype=bool, count=count)] = pb.BLOCK_STATUS_PRESENT
        statuses[np.fromiter(map(ns.pending.__contains__, hashes), dtype=bool, count=count)] = pb.BLOCK_STATUS_IN_PROGRESS
        if len(set(hashes)) != count:  # a hash repeated within the batch is written once
            first = {h: i for i, h in reversed(list(enumerate(hashes)))}
            repeated = [i for i, h in enumerate(hashes) if first[h] != i]
            statuses[repeated] = pb.BLOCK_STATUS_IN_PROGRESS
        wanted = np.flatnonzero(statuses == pb.BLOCK_STATUS_RESERVED)
        if self.store_threshold > 1 and not admit_all:
            refused = [i for i in wanted.tolist() if not self._admit(ns, hashes[i])]
            statuses[refused] = pb.BLOCK_STATUS_NOT_ADMITTED
            wanted = np.flatnonzero(statuses == pb.BLOCK_STATUS_RESERVED)
        ppb = ns.pages_per_block
        present = [hashes[i] for i in np.flatnonzero(statuses == pb.BLOCK_STATUS_PRESENT).tolist()]
        with self.held(ns, present):  # (answered PRESENT: not evicted to make room for the rest of the batch)
            evictable = self.pages.used - self._reserved_pages - self._pinned_pages  # committed, unpinned
            fit = min(len(wanted), (self.pages.free + evictable) // ppb)
            self._make_room(fit * ppb)  # (only for blocks that fit: evicting for the others gains nothing)
        fit = min(fit, self.pages.free // ppb)
        statuses[wanted[fit:]] = pb.BLOCK_STATUS_NO_SPACE
        if fit == 0:
            return ReserveResult(None, statuses)
        pages = self.pages.allocate(fit * ppb)
        slots = self.slots.allocate(fit)
        page_bytes = pages.astype("<u4").tobytes()
        step = ppb * 4
        chosen = [hashes[i] for i in wanted[:fit].tolist()]
        chunks = [page_bytes[j : j + step] for j in range(0, fit * step, step)]
        reserved = list(map(Block, itertools.repeat(ns, fit), chosen, chunks, slots.tolist()))
        ns.pending.update(zip(chosen, reserved, strict=True))
        self.state[slots] = RESERVED
        self.pins[slots] = 0
        self.hits[slots] = 0
        for slot, block in zip(slots.tolist(), reserved, strict=True):
            self.block_at[slot] = block
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
        _check_idle(reservation, "reservation")
        return reservation

    def check_write(self, reservation: Reservation, index: int, offset: int, length: int) -> Block:
        if index >= len(reservation.blocks):
            raise OutOfRange(f"block index {index} outside reservation of {len(reservation.blocks)} blocks")
        if offset + length > reservation.namespace.block_bytes:
            raise OutOfRange(
                f"write of {length} bytes at offset {offset} ends beyond the block's {reservation.namespace.block_bytes} bytes"
            )
        return reservation.blocks[index]

    def commit(self, session_id: str, reservation_id: int, checksums: np.ndarray | None = None) -> int:
        """Make a reservation's blocks visible; `checksums` (one per reserved block) are kept for loaders."""
        reservation = self.reservation(session_id, reservation_id)
        if checksums is not None and len(checksums) not in (0, len(reservation.blocks)):
            raise InvalidArgument(f"{len(checksums)} checksums for a reservation of {len(reservation.blocks)} blocks")
        self._end_reservation(reservation, "committed")
        ns = reservation.namespace
        slots = reservation.slots
        self.checksum[slots] = checksums if checksums is not None and len(checksums) else 0
        live = self.state[slots] == RESERVED
        blocks = reservation.blocks
        if not live.all():  # some were deleted while being written
            for block in (b for b, keep in zip(blocks, live.tolist(), strict=True) if not keep):
                self._free(block)
            blocks = [b for b, keep in zip(blocks, live.tolist(), strict=True) if keep]
            slots = slots[live]
        hashes = list(map(_hash_of, blocks))
        _consume(map(ns.pending.pop, hashes))
        ns.blocks.update(zip(hashes, blocks, strict=True))
        self.state[slots] = COMMITTED
        self.created_at[slots] = self.last_access[slots] = time.time()
        self.policy.insert_many(slots.tolist(), [(ns.id, h) for h in hashes])
        ns.counters.stored_blocks += len(blocks)
        return len(blocks)

    def withdraw(self, block: Block) -> None:
        """A reserved block that will not get its bytes (its read from disk failed, or it was deleted
        meanwhile): its reservation's commit frees it instead of making it visible or counting it."""
        if self.state[block.slot] == RESERVED:
            self._drop(block)

    def abort(self, session_id: str, reservation_id: int) -> None:
        self._abort(self.reservation(session_id, reservation_id), "aborted")

    def _abort(self, reservation: Reservation, how: str) -> None:
        self._end_reservation(reservation, how)
        pending = reservation.namespace.pending
        for block in reservation.blocks:
            if pending.get(block.hash) is block:
                del pending[block.hash]
            self._free(block)

    def _end_reservation(self, reservation: Reservation, how: str) -> None:
        del self._reservations[reservation.id]
        self._reserved_pages -= len(reservation.blocks) * reservation.namespace.pages_per_block
        self._ended[reservation.id] = how
        if len(self._ended) > _ENDED_MEMORY:
            self._ended.popitem(last=False)

    def _admit(self, ns: Namespace, block_hash: bytes) -> bool:
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
        victims: list[Block] = []
        short = pages - self.pages.free
        while short > 0:  # every block in the policy is unpinned: dropping it frees its pages at once
            slot = self.policy.pop_victim()
            if slot is None:
                break
            victim = self.block_at[slot]
            victims.append(victim)
            short -= victim.namespace.pages_per_block
        if not victims:
            return
        if self.on_evict is not None:
            try:
                self.on_evict(victims)
            except Exception:  # (demotion is best effort: the pool's accounting must hold whatever it does)
                log.exception("the eviction hook failed; its victims are evicted without it")
        for victim in victims:  # committed and unpinned (they were in the policy): free them together
            victim.namespace.counters.evictions += 1
            del victim.namespace.blocks[victim.hash]
        self._free_many(victims)

    def _drop(self, block: Block) -> None:
        """Make a block invisible now; its pages go back once no lease or reservation holds them."""
        ns, slot = block.namespace, block.slot
        state = self.state[slot]
        if state == RESERVED:
            del ns.pending[block.hash]
            self.state[slot] = DROPPED  # its reservation frees the pages when it ends
        elif state == COMMITTED:
            del ns.blocks[block.hash]
            self.policy.remove_many([slot], forget=True)
            if self.pins[slot]:
                self.state[slot] = DROPPED
                self._orphan_pages += ns.pages_per_block
            else:
                self._free(block)

    def _free(self, block: Block) -> None:
        self._free_many([block])

    def _free_many(self, blocks: list[Block]) -> None:
        self.pages.release(np.frombuffer(b"".join(b.pages for b in blocks), dtype="<u4"))
        slots = np.fromiter((b.slot for b in blocks), dtype=np.int64, count=len(blocks))
        self.slots.release(slots)
        self.state[slots] = FREE
        for slot in slots.tolist():
            self.block_at[slot] = None

    def delete(self, ns: Namespace, hashes: list[bytes]) -> int:
        victims = [b for b in map(ns.blocks.get, hashes) if b is not None]
        for block in victims:
            self._drop(block)
        return len(victims)

    def clear(self, ns: Namespace | None) -> int:
        """Drop every block of a namespace (or of all), as `_drop` does, its committed blocks together."""
        targets = [ns] if ns is not None else list(self.namespaces.values())
        deleted = 0
        for target in targets:
            committed = list(target.blocks.values())
            target.blocks.clear()
            slots = np.fromiter(map(_slot_of, committed), dtype=np.int64, count=len(committed))
            self.policy.remove_many(slots.tolist(), forget=True)
            pinned = self.pins[slots] > 0  # (their pages go back when their leases end)
            self.state[slots[pinned]] = DROPPED
            self._orphan_pages += int(pinned.sum()) * target.pages_per_block
            self._free_many([block for block, held in zip(committed, pinned.tolist(), strict=True) if not held])
            for block in list(target.pending.values()):
                self._drop(block)
            deleted += len(committed)
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
        leases = [lease for lease in self._leases.values() if lease.expires_at <= now and not lease.copies]
        reservations = [r for r in self._reservations.values() if r.expires_at <= now and not r.copies]
        for lease in leases:
            self._end_lease(lease)
        for reservation in reservations:
            self._abort(reservation, "expired")
        return len(leases), len(reservations)

    # ------------------------------------------------------------------ inspection

    def usage(self) -> PoolUsage:
        committed = sum(len(ns.blocks) * ns.pages_per_block for ns in list(self.namespaces.values()))  # (scrapes: another thread)
        return PoolUsage(
            used_pages=self.pages.used,
            committed_pages=committed,
            reserved_pages=self._reserved_pages,
            orphan_pages=self._orphan_pages,
            pinned_blocks=int(np.count_nonzero(self.pins)),
        )

    def committed_blocks(self, ns: Namespace | None = None) -> Iterator[Block]:
        targets = [ns] if ns is not None else list(self.namespaces.values())
        for target in targets:
            yield from target.blocks.values()

    def find_block(self, ns: Namespace, block_hash: bytes) -> Block:
        if len(block_hash) != ns.hash_bytes:
            raise InvalidArgument(f"hash has {len(block_hash)} bytes; the namespace's hashes have {ns.hash_bytes}")
        block = ns.blocks.get(block_hash)
        if block is None:
            raise NotFound(f"block {block_hash.hex()} is not in namespace {ns.id}")
        return block
