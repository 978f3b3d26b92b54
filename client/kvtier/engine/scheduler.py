"""Scheduler-side decisions: which prompt prefixes are cached, what to load and what to store.

Lookups never block the scheduler: a request's first query is queued and answered "not known yet"
(vLLM asks again next step); queued queries go to the daemon as one LookupBatch per step. Only blocks
the daemon reported present are promised, always leaving the last prompt token to compute. A request
whose load failed is not offered a hit again (that would loop), and the blocks it recomputes are
stored again: the load may have failed for one worker's blocks alone (a TP rank or pipeline stage
that skipped or lost them while the lookup, which asks for the first rank's keys, found them), and
only a store puts them back (the other workers' stores of blocks they hold are no-ops).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

from kvtier.engine.jobs import LoadJob, StepPlan, StoreJob
from kvtier.engine.link import DaemonLink, call_error
from kvtier.engine.rank_keys import keyed, rank_suffix
from kvtier.v1 import kvtier_pb2 as pb

log = logging.getLogger("kvtier.engine")


@dataclass
class SchedulerStats:
    lookups: int = 0
    lookup_timeouts: int = 0
    hit_tokens: int = 0
    queried_tokens: int = 0
    load_failures: int = 0
    store_blocks_planned: int = 0


@dataclass
class _Request:
    hashes: list[bytes]  # the prefix hashes a lookup covers
    hit_blocks: int | None = None  # None while the lookup is in flight
    asked_at: float = 0.0
    local_blocks: int = 0  # blocks vLLM already had when the hit was taken
    load_blocks: int = 0
    stored_upto: int = 0  # blocks [0, stored_upto) are stored, loaded or skipped
    failed: bool = False
    store_limit: int = 0  # blocks eligible for storing


@dataclass
class PrefixPlanner:
    link: DaemonLink
    block_size: int
    namespace_spec: bytes
    offload_prompt_only: bool = True
    lookup_wait_s: float = 1.0
    drop_last_hit_block: bool = False  # speculative decoding on the target's hidden states (EAGLE, MTP)
    stats: SchedulerStats = field(default_factory=SchedulerStats)
    _requests: dict[str, _Request] = field(default_factory=dict)
    _queued: dict[str, list[bytes]] = field(default_factory=dict)
    _in_flight: list[tuple[list[str], Future]] = field(default_factory=list)
    _loads: list[LoadJob] = field(default_factory=list)
    _loading: set[str] = field(default_factory=set)  # requests whose load the workers have not reported
    _lookup_suffix: bytes = field(init=False)  # lookups ask for the first TP rank's keys

    def __post_init__(self) -> None:
        self._lookup_suffix = rank_suffix(pb.NamespaceSpec.FromString(self.namespace_spec), 0)

    # ------------------------------------------------------------------ lookups

    def matched_tokens(
        self, req_id: str, hashes: list[bytes], num_prompt_tokens: int, num_computed_tokens: int, max_offload_tokens: int | None
    ) -> tuple[int | None, bool]:
        """vLLM's get_num_new_matched_tokens: (tokens to load beyond num_computed_tokens, load is async)."""
        self._collect()
        usable = min(len(hashes), (num_prompt_tokens - 1) // self.block_size)  # leave the last prompt token
        local = num_computed_tokens // self.block_size
        state = self._requests.get(req_id)
        if state is None or (not state.failed and state.hit_blocks is not None and len(state.hashes) != usable):
            limit = num_prompt_tokens // self.block_size if self.offload_prompt_only else 1 << 62
            if max_offload_tokens is not None:
                limit = min(limit, max_offload_tokens // self.block_size)
            stored = state.stored_upto if state is not None else 0
            state = self._requests[req_id] = _Request(hashes=list(hashes[:usable]), stored_upto=stored, store_limit=limit)
        if state.failed or usable <= local or not self.link.available:
            return 0, False
        if state.hit_blocks is None:
            if req_id not in self._queued and not any(req_id in ids for ids, _ in self._in_flight):
                self._queued[req_id] = state.hashes
                state.asked_at = time.monotonic()
                return None, False
            if time.monotonic() - state.asked_at > self.lookup_wait_s:
                self.stats.lookup_timeouts += 1
                state.hit_blocks = 0
                return 0, False
            return None, False
        # With speculative decoding on the target's hidden states (EAGLE, MTP) the draft layers' KV of
        # a block's last tokens is computed with the tokens after it, which the request that stored it
        # may not share with this one: vLLM drops the last block of its own prefix hits, and so do we.
        hit = min(state.hit_blocks - self.drop_last_hit_block, usable)
        if hit <= local:
            return 0, False
        state.local_blocks = local
        return (hit - local) * self.block_size, True

    def _collect(self) -> None:
        """Take in lookup answers that have arrived."""
        pending = []
        for req_ids, future in self._in_flight:
            if not future.done():
                pending.append((req_ids, future))
                continue
            hits = future.result() if call_error(future) is None else []  # (failed: those requests miss)
            if len(hits) != len(req_ids):  # (failed, or an answer of another length: misses, never a raise here)
                hits = [0] * len(req_ids)
            for req_id, hit in zip(req_ids, hits, strict=True):
                state = self._requests.get(req_id)
                if state is not None and state.hit_blocks is None:
                    state.hit_blocks = hit
                    self.stats.lookups += 1
                    self.stats.queried_tokens += len(state.hashes) * self.block_size
        self._in_flight = pending

    def _flush_lookups(self) -> None:
        if not self._queued:
            return
        req_ids, queries = list(self._queued), [keyed(q, self._lookup_suffix) for q in self._queued.values()]
        self._queued = {}

        def call(client, ns):
            return [r.hit_count for r in client.lookup_batch(ns, queries)]

        self._in_flight.append((req_ids, self.link.submit(call)))

    # ------------------------------------------------------------------ loads and stores

    def after_alloc(self, req_id: str, block_ids: list[int], num_external_tokens: int) -> None:
        """vLLM's update_state_after_alloc: plan the load of the promised blocks."""
        state = self._requests.get(req_id)
        if state is None or num_external_tokens <= 0:
            return
        count = num_external_tokens // self.block_size
        first = state.local_blocks
        state.load_blocks = count
        state.stored_upto = max(state.stored_upto, first + count)
        self._loads.append(LoadJob(req_id, block_ids[first : first + count], state.hashes[first : first + count]))
        self._loading.add(req_id)
        self.stats.hit_tokens += num_external_tokens

    def plan_step(
        self, scheduled: list[tuple[str, int, list[bytes], list[int]]], fresh_blocks: list[int] | None = None
    ) -> StepPlan:
        """vLLM's build_connector_meta. `scheduled`: (req_id, tokens computed once this step ran,
        the request's block hashes, its block ids) for every request in the step; `fresh_blocks` (GPU
        engines): the blocks vLLM allocated afresh for the step's forward (the workers fence them
        before it, and a load's blocks before the load)."""
        self._flush_lookups()
        plan = StepPlan(namespace_spec=self.namespace_spec, fresh_blocks=list(fresh_blocks or ()))
        planned: list[tuple[_Request, int]] = []
        for req_id, computed, hashes, block_ids in scheduled:
            state = self._requests.get(req_id)
            if state is None:
                continue
            full = min(computed // self.block_size, len(hashes), len(block_ids), state.store_limit)
            if full > state.stored_upto:
                plan.stores.append(StoreJob(req_id, block_ids[state.stored_upto : full], list(hashes[state.stored_upto : full])))
                planned.append((state, full))
        # (nothing changes before here: should anything raise, the step plans nothing and loses nothing)
        for state, full in planned:
            self.stats.store_blocks_planned += full - state.stored_upto
            state.stored_upto = full
        plan.loads, self._loads = self._loads, []
        return plan

    def renamespace(self, namespace_spec: bytes) -> None:
        """Blocks go to another namespace from now on (the model's weights may have been replaced in
        place). Requests known so far neither get hits nor store: their blocks may hold KV of the old
        weights, and so may what they compute on top of them. Loads already planned go to the new
        namespace, miss and are recomputed."""
        self.namespace_spec = namespace_spec
        for state in self._requests.values():
            state.failed, state.store_limit = True, 0

    def on_transfers(self, loaded: set[str], failed: set[str]) -> None:
        """vLLM's update_connector_output: remember failed loads so they are not offered again; the
        blocks the request recomputes are stored (vLLM counts them computed only once recomputed)."""
        self._loading -= loaded
        for req_id in failed:
            state = self._requests.get(req_id)
            if state is not None:
                state.failed = True
                state.stored_upto = min(state.stored_upto, state.local_blocks)
                self.stats.load_failures += 1
                log.warning("load from kvtierd failed for request %s; it recomputes", req_id)

    def finished(self, req_id: str) -> bool:
        """vLLM's request_finished: True while a load still writes into the request's blocks, so vLLM
        keeps them until the workers report it (and then frees them). Stores never hold them: on GPU
        engines, where the daemon reads the blocks after the step, the workers fence the blocks a later
        step allocates afresh instead (`StepPlan.fresh_blocks`), so that vLLM can reset its prefix
        cache or sleep at once."""
        self._requests.pop(req_id, None)
        self._queued.pop(req_id, None)
        return req_id in self._loading
