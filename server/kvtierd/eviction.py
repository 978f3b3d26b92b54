"""Eviction policies of the RAM tier, over block slots (ints).

A policy holds only committed, unpinned blocks: pinned or reserved blocks are never inside, so they can
never be chosen as victims. Batch methods take lists of slots and run their loops in C where they can
(`deque(map(...), maxlen=0)` consumes an iterator without a Python-level loop).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable, Sequence
from itertools import repeat
from typing import Protocol


def _consume(iterator) -> None:
    deque(iterator, maxlen=0)


class EvictionPolicy(Protocol):
    def insert_many(self, slots: Sequence[int], keys: Sequence[Hashable]) -> None:
        """Newly committed blocks; `keys` identify them across evictions (for ghost lists)."""

    def access_many(self, slots: Sequence[int]) -> None:
        """Hits on blocks inside the policy."""

    def refresh_many(self, slots: Sequence[int]) -> None:
        """Blocks to keep as if just inserted, without counting a use (ARC: within their own list)."""

    def remove_many(self, slots: Sequence[int], forget: bool) -> None:
        """Take blocks out: pinned (forget=False, restore later) or deleted (forget=True)."""

    def restore_many(self, slots: Sequence[int]) -> None:
        """Put back blocks taken out by remove_many(forget=False); they were just used."""

    def pop_victim(self) -> int | None:
        """Remove and return the slot to evict next, or None when the policy is empty."""

    def unevict(self, slot: int, key: Hashable) -> None:
        """Put back a victim whose eviction was undone: the next victim again, no use counted (ARC: in
        the list it left, its ghost forgotten)."""

    def __len__(self) -> int: ...


class LRUPolicy:
    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()

    def insert_many(self, slots, keys) -> None:
        self._order.update(dict.fromkeys(slots))

    def access_many(self, slots) -> None:
        _consume(map(self._order.move_to_end, slots))

    refresh_many = access_many

    def remove_many(self, slots, forget: bool) -> None:
        _consume(map(self._order.pop, slots, repeat(None)))

    def restore_many(self, slots) -> None:
        self.insert_many(slots, ())

    def pop_victim(self) -> int | None:
        if not self._order:
            return None
        return self._order.popitem(last=False)[0]

    def unevict(self, slot: int, key: Hashable) -> None:
        self._order[slot] = None
        self._order.move_to_end(slot, last=False)

    def __len__(self) -> int:
        return len(self._order)


class ARCPolicy:
    """Adaptive Replacement Cache (Megiddo & Modha) over block counts.

    T1 holds blocks seen once, T2 blocks hit again; B1/B2 remember the keys of blocks evicted from
    each, and a hit on a ghost moves the target size `p` of T1 towards the list that would have kept it.
    """

    def __init__(self) -> None:
        self._t1: OrderedDict[int, None] = OrderedDict()
        self._t2: OrderedDict[int, None] = OrderedDict()
        self._b1: OrderedDict[Hashable, None] = OrderedDict()
        self._b2: OrderedDict[Hashable, None] = OrderedDict()
        self._keys: dict[int, Hashable] = {}
        self.p = 0.0

    def insert_many(self, slots, keys) -> None:
        for slot, key in zip(slots, keys, strict=True):
            self._keys[slot] = key
            capacity = max(len(self), 1)
            if key in self._b1:
                self.p = min(float(capacity), self.p + max(len(self._b2) / len(self._b1), 1.0))
                del self._b1[key]
                self._t2[slot] = None
            elif key in self._b2:
                self.p = max(0.0, self.p - max(len(self._b1) / len(self._b2), 1.0))
                del self._b2[key]
                self._t2[slot] = None
            else:
                self._t1[slot] = None

    def access_many(self, slots) -> None:
        for slot in slots:
            if slot in self._t1:
                del self._t1[slot]
                self._t2[slot] = None
            else:
                self._t2.move_to_end(slot)

    def refresh_many(self, slots) -> None:
        for slot in slots:
            (self._t1 if slot in self._t1 else self._t2).move_to_end(slot)

    def remove_many(self, slots, forget: bool) -> None:
        for slot in slots:
            self._t1.pop(slot, None)
            self._t2.pop(slot, None)
            if forget:
                self._keys.pop(slot, None)

    def restore_many(self, slots) -> None:
        for slot in slots:
            self._t2[slot] = None

    def pop_victim(self) -> int | None:
        if self._t1 and (len(self._t1) > self.p or not self._t2):
            slot = self._t1.popitem(last=False)[0]
            ghosts = self._b1
        elif self._t2:
            slot = self._t2.popitem(last=False)[0]
            ghosts = self._b2
        else:
            return None
        ghosts[self._keys.pop(slot)] = None
        limit = max(len(self), 1)
        while len(self._b1) + len(self._b2) > limit:
            longer = self._b1 if len(self._b1) >= len(self._b2) else self._b2
            longer.popitem(last=False)
        return slot

    def unevict(self, slot: int, key: Hashable) -> None:
        self._keys[slot] = key
        if key in self._b2:
            del self._b2[key]
            listed = self._t2
        else:
            self._b1.pop(key, None)
            listed = self._t1
        listed[slot] = None
        listed.move_to_end(slot, last=False)

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)


def make_policy(name: str) -> EvictionPolicy:
    if name == "lru":
        return LRUPolicy()
    if name == "arc":
        return ARCPolicy()
    raise ValueError(f"unknown eviction policy {name!r}")
