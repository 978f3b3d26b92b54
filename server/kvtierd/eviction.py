"""Eviction policies of the RAM tier. They order committed, unpinned blocks; pinned or reserved
blocks are never inside a policy, so they can never be chosen as victims."""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Protocol, TypeVar


class Keyed(Protocol):
    @property
    def key(self) -> Hashable:
        """Identifies the block across evictions (for ghost lists)."""


Item = TypeVar("Item", bound=Keyed)


class EvictionPolicy(Protocol[Item]):
    def insert(self, item: Item) -> None:
        """A newly committed block."""

    def access(self, item: Item) -> None:
        """A hit on a block inside the policy."""

    def remove(self, item: Item) -> None:
        """Take a block out (pinned or deleted); no-op if absent."""

    def restore(self, item: Item) -> None:
        """Put back a block that was taken out by remove() (it was just used)."""

    def pop_victim(self) -> Item | None:
        """Remove and return the block to evict next, or None when the policy is empty."""

    def __len__(self) -> int: ...


class LRUPolicy:
    def __init__(self) -> None:
        self._order: OrderedDict = OrderedDict()

    def insert(self, item) -> None:
        self._order[item] = None

    def access(self, item) -> None:
        if item in self._order:
            self._order.move_to_end(item)

    def remove(self, item) -> None:
        self._order.pop(item, None)

    def restore(self, item) -> None:
        self._order[item] = None
        self._order.move_to_end(item)

    def pop_victim(self):
        if not self._order:
            return None
        item, _ = self._order.popitem(last=False)
        return item

    def __len__(self) -> int:
        return len(self._order)


class ARCPolicy:
    """Adaptive Replacement Cache (Megiddo & Modha) over block counts.

    T1 holds blocks seen once, T2 blocks hit again; B1/B2 remember the keys of blocks evicted from
    each, and a hit on a ghost moves the target size `p` of T1 towards the list that would have kept it.
    """

    def __init__(self) -> None:
        self._t1: OrderedDict = OrderedDict()
        self._t2: OrderedDict = OrderedDict()
        self._b1: OrderedDict = OrderedDict()
        self._b2: OrderedDict = OrderedDict()
        self.p = 0.0

    def insert(self, item) -> None:
        key = item.key
        capacity = max(len(self), 1)
        if key in self._b1:
            self.p = min(float(capacity), self.p + max(len(self._b2) / len(self._b1), 1.0))
            del self._b1[key]
            self._t2[item] = None
        elif key in self._b2:
            self.p = max(0.0, self.p - max(len(self._b1) / len(self._b2), 1.0))
            del self._b2[key]
            self._t2[item] = None
        else:
            self._t1[item] = None

    def access(self, item) -> None:
        if item in self._t1:
            del self._t1[item]
            self._t2[item] = None
        elif item in self._t2:
            self._t2.move_to_end(item)

    def remove(self, item) -> None:
        self._t1.pop(item, None)
        self._t2.pop(item, None)

    def restore(self, item) -> None:
        self.remove(item)
        self._t2[item] = None

    def pop_victim(self):
        if self._t1 and (len(self._t1) > self.p or not self._t2):
            item, _ = self._t1.popitem(last=False)
            ghosts = self._b1
        elif self._t2:
            item, _ = self._t2.popitem(last=False)
            ghosts = self._b2
        else:
            return None
        ghosts[item.key] = None
        self._trim_ghosts()
        return item

    def _trim_ghosts(self) -> None:
        limit = max(len(self), 1)
        while len(self._b1) + len(self._b2) > limit:
            longer = self._b1 if len(self._b1) >= len(self._b2) else self._b2
            longer.popitem(last=False)

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)


def make_policy(name: str) -> EvictionPolicy:
    if name == "lru":
        return LRUPolicy()
    if name == "arc":
        return ARCPolicy()
    raise ValueError(f"unknown eviction policy {name!r}")
