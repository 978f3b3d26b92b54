"""The filesystem tier's index: which blocks are on disk, their use, the tier's bytes and its eviction.

Pure bookkeeping on the event loop, like BlockStore: no I/O. A block enters the index only when its file
is completely written, so lookups never see a block that is still being written. Bytes are charged
when a write starts (`reserve`), so writes in flight count against --fs-size too.
"""

from __future__ import annotations

import itertools
import time
from collections import defaultdict
from dataclasses import dataclass, fields

from kvtierd.eviction import make_policy
from kvtierd.fs_format import charged_bytes


@dataclass(slots=True, eq=False)
class FsEntry:
    namespace: str
    hash: bytes
    slot: int
    charge: int
    created_at: float
    last_access: float
    hits: int = 0


@dataclass
class FsCounters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    stored_blocks: int = 0  # written to disk (demoted or written through)
    loaded_blocks: int = 0  # promoted into the pool
    checksum_failures: int = 0

    def add(self, other: FsCounters, times: int = 1) -> None:
        """Add `other`'s counts, each `times` over (`times` a block size: their bytes)."""
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name) * times)


class FsIndex:
    def __init__(self, capacity: int, eviction: str) -> None:
        self.capacity = capacity
        self.indexed_bytes = 0
        self.inflight_bytes = 0
        self.removing_bytes = 0  # files out of the index whose removal is still queued (FsTier._remove)
        self.changes = 0  # blocks added and removed so far (the index file is rewritten when it moved)
        self.blocks: dict[str, dict[bytes, FsEntry]] = defaultdict(dict)
        self.counters: dict[str, FsCounters] = defaultdict(FsCounters)
        self.block_bytes: dict[str, int] = {}  # per namespace that has had a block here (byte counters)
        self._by_slot: dict[int, FsEntry] = {}
        self._slots = itertools.count()
        self.policy = make_policy(eviction)

    @property
    def used_bytes(self) -> int:
        return self.indexed_bytes + self.inflight_bytes + self.removing_bytes

    def __len__(self) -> int:
        return len(self._by_slot)

    def get(self, namespace: str, block_hash: bytes) -> FsEntry | None:
        return self.blocks[namespace].get(block_hash)

    def hit(self, namespace: str, hashes: list[bytes], misses: int) -> None:
        """Count a lookup that found `hashes` on disk and not `misses` more; marks them used."""
        table = self.blocks[namespace]
        entries = [table[h] for h in hashes]
        counters = self.counters[namespace]
        counters.hits += len(entries)
        counters.misses += misses
        now = time.time()
        for entry in entries:
            entry.hits += 1
            entry.last_access = now
        self.policy.access_many([e.slot for e in entries])

    def demoted(self, entries: list[FsEntry]) -> None:
        """Blocks that the pool let go of and that are on disk already: their files, now their only
        copies, are to be evicted last, like the blocks just written beside them (not a hit: ARC
        keeps a block seen once among those seen once)."""
        now = time.time()
        for entry in entries:
            entry.last_access = now
        self.policy.refresh_many([e.slot for e in entries])

    def reserve(self, block_bytes: int) -> list[FsEntry] | None:
        """Charge a write of one block, evicting least valuable blocks to stay under the capacity.
        Returns the evicted entries (their files are to be removed), or None when it cannot fit
        because writes in flight and files still being removed fill the tier (nothing is evicted then)."""
        charge = charged_bytes(block_bytes)
        if self.inflight_bytes + self.removing_bytes + charge > self.capacity:
            return None
        victims = []
        while self.used_bytes + charge > self.capacity:
            entry = self._by_slot[self.policy.pop_victim()]
            self._forget(entry)
            self.counters[entry.namespace].evictions += 1
            victims.append(entry)
        self.inflight_bytes += charge
        return victims

    def restore(self, entry: FsEntry) -> bool:
        """Index again an entry `reserve` evicted, its file intact after all (the write it made room for
        failed), unless it no longer fits or its block was indexed again meanwhile. It is put back
        where it was, the next to be evicted (restore a write's victims last first)."""
        taken = entry.hash in self.blocks[entry.namespace]
        if taken or self.used_bytes + entry.charge > self.capacity:
            return False
        self._enter(entry)  # (its eviction stays counted: the counter only goes up)
        self.policy.unevict(entry.slot, (entry.namespace, entry.hash))
        return True

    def unreserve(self, block_bytes: int) -> None:
        self.inflight_bytes -= charged_bytes(block_bytes)

    def add(self, namespace: str, block_hash: bytes, block_bytes: int, created_at: float, reserved: bool) -> FsEntry:
        """Index a block whose file is complete (charged by `reserve` when `reserved`)."""
        charge = charged_bytes(block_bytes)
        self.block_bytes[namespace] = block_bytes
        if reserved:
            self.inflight_bytes -= charge
        old = self.blocks[namespace].get(block_hash)
        if old is not None:
            self.remove(old)
        entry = FsEntry(namespace, block_hash, next(self._slots), charge, created_at, created_at)
        self._enter(entry)
        self.policy.insert_many([entry.slot], [(namespace, block_hash)])
        return entry

    def _enter(self, entry: FsEntry) -> None:
        self.blocks[entry.namespace][entry.hash] = entry
        self._by_slot[entry.slot] = entry
        self.indexed_bytes += entry.charge
        self.changes += 1

    def add_many(self, namespace: str, hashes: list[bytes], block_bytes: int) -> None:
        """Index blocks found on disk at start (times unknown until a block is first read)."""
        charge = charged_bytes(block_bytes)
        self.block_bytes[namespace] = block_bytes
        table = self.blocks[namespace]
        hashes = [h for h in hashes if h not in table]
        slots = list(itertools.islice(self._slots, len(hashes)))
        entries = list(
            map(
                FsEntry,
                itertools.repeat(namespace),
                hashes,
                slots,
                itertools.repeat(charge),
                itertools.repeat(0.0),
                itertools.repeat(0.0),
            )
        )
        table.update(zip(hashes, entries, strict=True))
        self._by_slot.update(zip(slots, entries, strict=True))
        self.indexed_bytes += charge * len(entries)
        self.changes += len(entries)
        self.policy.insert_many(slots, [(namespace, h) for h in hashes])

    def remove(self, entry: FsEntry) -> None:
        """Take an entry out (deleted, or its file turned out bad or missing)."""
        if self._by_slot.get(entry.slot) is entry:
            self.policy.remove_many([entry.slot], forget=True)
            self._forget(entry)

    def _forget(self, entry: FsEntry) -> None:
        del self._by_slot[entry.slot]
        del self.blocks[entry.namespace][entry.hash]
        self.indexed_bytes -= entry.charge
        self.changes += 1

    def entries(self, namespace: str | None = None) -> list[FsEntry]:
        if namespace is not None:
            return list(self.blocks[namespace].values())
        return list(self._by_slot.values())

    def over_capacity(self) -> list[FsEntry]:
        """Evict until the indexed blocks fit (after a restart with a smaller --fs-size)."""
        victims = []
        while self.used_bytes > self.capacity and len(self.policy):
            entry = self._by_slot[self.policy.pop_victim()]
            self._forget(entry)
            victims.append(entry)
        return victims
