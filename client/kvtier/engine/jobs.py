"""What the scheduler side hands the workers each step (pickled inside vLLM's connector metadata)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LoadJob:
    """Fill the engine blocks `block_ids` with the cached blocks `hashes` (a prefix run)."""

    req_id: str
    block_ids: list[int]
    hashes: list[bytes]


@dataclass
class StoreJob:
    """Copy the engine blocks `block_ids`, just computed, into the cache under `hashes`."""

    req_id: str
    block_ids: list[int]
    hashes: list[bytes]


@dataclass
class StepPlan:
    namespace_spec: bytes = b""  # serialized NamespaceSpec, so workers register the same namespace
    loads: list[LoadJob] = field(default_factory=list)
    stores: list[StoreJob] = field(default_factory=list)
    # GPU engines: the blocks vLLM allocated afresh for this step's forward; stores still reading one of
    # them (a request's finished or preempted since) must end first; all stores when `fence_all` (the
    # plan could not be made: which blocks are fresh is unknown)
    fresh_blocks: list[int] = field(default_factory=list)
    fence_all: bool = False
