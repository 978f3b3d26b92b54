"""Worker-side transfers between the engine's KV cache and the daemon's pool.

Two transports, chosen per daemon connection:
- cuda_ipc (a GPU cache the daemon opened): the daemon copies. A load is one Load call that returns
  when the blocks are in the engine's memory and verified. A store records the engine's ready event
  after the forward and sends one Reserve call; the daemon's copy waits for that event, so the
  engine's stream never waits for a store. The blocks must not be written again before the daemon
  copied them: vLLM frees a finished or preempted request's blocks at once (so that resetting its
  prefix cache, or going to sleep, never waits for a store), and before a step writes blocks it
  allocated afresh (`fence`: each step's plan names them), the store calls still reading any of them
  are withdrawn if not yet sent, or else awaited. "Done" means the daemon answered, or the call's
  deadline (fixed when it is submitted) and CUDA_ANSWER_GRACE_S have passed: a call that failed here
  after its request went out (a timeout, a broken connection) may still have a copy under way in the
  daemon, so its blocks stay held until then (`DeviceCall`); the daemon starts no copy that cannot
  end by the deadline.
- shm (CPU caches, or a daemon that refused cuda_ipc): the engine copies. Loads pin the blocks, copy
  them out of the mapped pool into the engine's blocks, verify their checksums and release. A GPU
  cache copies with the daemon's kernel (GpuKV), ordered and fenced like cuda_ipc. A CPU cache's
  stores copy the just-computed blocks out of the KV cache at the end of the step (so the engine may
  reuse the blocks at once) and reserve, write and commit them on the link thread; pending store
  copies are bounded, and beyond the bound new stores are skipped.
Loads run on the link thread while the request waits (vLLM's async load); a CPU cache's copy out of
the pool runs on the engine's thread between steps (see `_load`). Anything short of the full
run (evicted meanwhile, corrupt, daemon gone) is reported as a failed load, so vLLM recomputes.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, TypeVar

import numpy as np

from kvtier import checksum
from kvtier.client import CUDA_ANSWER_GRACE_S, KVTierClient, daemon_done_with
from kvtier.engine.jobs import LoadJob, StoreJob
from kvtier.engine.kv_blocks import LayerMajorKV

if TYPE_CHECKING:
    from kvtier.engine.gpu_kv import GpuKV
from kvtier.engine.link import DaemonLink, call_error
from kvtier.engine.rank_keys import keyed, rank_suffix
from kvtier.ops import LookupResult, Namespace, Reservation
from kvtier.pool_view import PageView
from kvtier.v1 import kvtier_pb2 as pb

log = logging.getLogger("kvtier.engine")

T = TypeVar("T")


@dataclass
class WorkerStats:
    loaded_blocks: int = 0
    load_failures: int = 0
    stored_blocks: int = 0
    store_skipped_blocks: int = 0
    store_failures: int = 0
    loaded_bytes: int = 0
    stored_bytes: int = 0


MAX_PENDING_GPU_STORES = 32  # a GPU engine's store calls (one per step) waiting for the daemon; more are skipped


class LoadFailed(Exception):
    pass


class PastDeadline(Exception):
    """A copy call's deadline passed before it could start, or before the engine's own copy ended."""


@dataclass
class DeviceCall:
    """A call during which the engine's blocks may be copied (by the daemon with cuda_ipc, or by the
    engine's own side stream with shm), and how long it holds them. Its deadline is fixed when it is
    submitted; it is not sent after it, and the daemon starts no copy that cannot end by it. The call
    holds the blocks until it has ended and, when it failed without the daemon being done with it
    (a timeout, a broken connection), until its deadline and CUDA_ANSWER_GRACE_S have passed (a
    copy the daemon started may land until then)."""

    deadline_ns: int
    future: Future | None = None
    store_jobs: list[StoreJob] = field(default_factory=list)  # a store call's: its step's jobs
    ready: int = 0  # a store call's: the ring's ready event it follows
    generation: int = 0  # a store call's: the namespace it was planned for (BlockTransfers._generation)
    _held_until_ns: int = 0
    _engine_copies: int = 0  # the engine's own copies into its blocks under way (shm loads on a GPU)

    @classmethod
    def due_in(cls, seconds: float) -> DeviceCall:
        return cls(time.monotonic_ns() + int(seconds * 1e9))

    @property
    def hold_end_ns(self) -> int:
        """The latest the blocks can be held."""
        return self.deadline_ns + int(CUDA_ANSWER_GRACE_S * 1e9)

    def run(self, call: Callable[[int], T], daemon_copies: bool) -> T:
        """On the link thread: `call(deadline_ns)`, unless the deadline has passed. `daemon_copies`:
        the daemon copies the blocks (cuda_ipc), so a failure here may leave a copy of its under way;
        otherwise (the engine copies, on this thread) nothing touches them once the call has ended."""
        if time.monotonic_ns() >= self.deadline_ns:
            raise PastDeadline("not sent: its deadline passed while it waited for the link")
        try:
            return call(self.deadline_ns)
        except BaseException as exc:
            if daemon_copies and not daemon_done_with(exc):
                self._held_until_ns = self.hold_end_ns
            raise

    def held_until_ns(self) -> int:
        return self._held_until_ns if self.future.done() else self.hold_end_ns

    @contextlib.contextmanager
    def engine_copy(self):
        """The engine's own copy into the blocks runs meanwhile (on the link thread, waited for there):
        the call is not settled before it has ended, whatever its deadline."""
        self._engine_copies += 1
        try:
            yield
        finally:
            self._engine_copies -= 1

    def settled(self) -> bool:
        """It holds the blocks no more: an unanswered call past its hold is given up, unless the
        engine's own copy into them is still under way (vLLM would hand them to another request),
        and one still waiting for the link thread past its deadline (behind a stuck call, say) is
        withdrawn here, since it would not be sent now. (A withdrawn load is reported failed; a
        withdrawn store's blocks are lost, as a store refused for its deadline loses them.)"""
        now = time.monotonic_ns()
        if now >= self.deadline_ns and self.future.cancel():
            return True
        return not self._engine_copies and now >= self.held_until_ns()


@dataclass(frozen=True)
class _Pinned:
    """Blocks the daemon pinned for a load, the pool mapping they are in, and the session that holds
    their lease (lease ids count from 1 again in a restarted daemon's sessions)."""

    result: LookupResult
    view: PageView
    client: KVTierClient


def _release_if_held_by(pinned: _Pinned, client: KVTierClient, ns: Namespace) -> None:
    """Release a load's lease through the session that holds it; after a reconnect the lease went with
    the old session, and the same id in the new one is another load's."""
    if client is pinned.client:
        client.release(pinned.result.lease_id)


@dataclass
class BlockTransfers:
    link: DaemonLink
    kv: LayerMajorKV | GpuKV | None  # None: the engine's cache layout is not supported; every load fails
    max_pending_store_bytes: int = 512 << 20
    tp_rank: int = 0
    load_delay_s: float = 0.0
    pp_rank: int = 0  # pipeline stage: each stage holds other layers, so it keeps blocks of its own
    stats: WorkerStats = field(default_factory=WorkerStats)
    _spec: bytes = b""
    _key_suffix: bytes = b""  # follows each block hash in this rank's keys (rank_keys)
    _generation: int = 0  # counts the namespaces adopted: a call made for an earlier one is not sent
    _disabled: str = ""
    _asleep: bool = False  # the KV cache's memory is unmapped (vLLM's sleep mode): nothing copies into or out of it
    _loads: dict[str, tuple[LoadJob, DeviceCall]] = field(default_factory=dict)
    _pending_store_bytes: int = 0
    _pending_gpu_stores: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _gpu_stores: list[DeviceCall] = field(default_factory=list)  # store calls that may still read the engine's blocks

    def configure(self, namespace_spec: bytes) -> None:
        """Adopt the namespace the scheduler side computed (the TP ranks share it, each with keys of its
        own; each pipeline stage has its own, of its own layers: the scheduler's is stage 0's, and
        stages may hold other numbers of layers); refuse it if our cache's geometry differs."""
        if not namespace_spec or namespace_spec == self._spec:
            return
        self._spec = namespace_spec
        if self.kv is None:
            self._disabled = "unsupported KV cache layout"
            return
        try:
            spec = pb.NamespaceSpec.FromString(namespace_spec)
        except Exception:  # noqa: BLE001 (a bad plan disables transfers, it never raises into the engine)
            self._disabled = "unreadable namespace spec"
            return
        if self.pp_rank and spec.chunk_bytes and self.kv.block_bytes % spec.chunk_bytes[0] == 0:
            layers = self.kv.block_bytes // spec.chunk_bytes[0]  # (one KV cache group: every layer's page alike)
            spec.num_layers, spec.block_bytes, spec.chunk_bytes[:] = layers, self.kv.block_bytes, [spec.chunk_bytes[0]] * layers
        if spec.block_bytes != self.kv.block_bytes:
            self._disabled = f"namespace block_bytes {spec.block_bytes} != KV cache block bytes {self.kv.block_bytes}"
            log.error("kvtier transfers disabled: %s", self._disabled)
            return
        self._disabled = ""
        self._generation += 1  # (before the link's namespace changes: see _while_current)
        spec.pp_rank = self.pp_rank
        self._key_suffix = rank_suffix(spec, self.tp_rank)
        if self._gpu_kv is not None:
            try:
                self.link.set_cuda_kv(self._gpu_kv.describe())
            except Exception:  # noqa: BLE001 (memory CUDA IPC cannot share, e.g. a sleep-mode allocator's: shm)
                log.exception("kvtier cannot share this KV cache with the daemon (cuda_ipc); the engine copies (shm)")
        self.link.set_namespace_spec(spec)

    def sleep(self) -> None:
        """vLLM's sleep mode unmaps the KV cache's memory (unregister_kv_caches): from now on nothing
        is copied into or out of it, and this returns once no call holds its blocks (calls waiting
        for the link thread then fail at once; each is held at most until its deadline and
        CUDA_ANSWER_GRACE_S). Idempotent."""
        self._asleep = True
        calls = [call for _, call in self._loads.values()] + self._gpu_stores
        while not all(call.settled() for call in calls):
            time.sleep(0.005)

    def wake(self) -> None:
        """The KV cache's memory is back (restore_kv_caches). Idempotent."""
        self._asleep = False

    def _while_current(self, call: Callable[[KVTierClient, Namespace], T]) -> Callable[[KVTierClient, Namespace], T]:
        """`call` for the link thread, not run there if the engine is asleep (its KV cache unmapped)
        or adopted another namespace since (after vLLM reset its prefix cache, as it does when
        weights are replaced: blocks of the old weights must not land in the new namespace). The
        generation goes up before the link's namespace changes, so a call that finds its generation
        current found the old namespace."""
        generation = self._generation

        def if_current(client: KVTierClient, ns: Namespace) -> T:
            self._check_awake()
            if generation != self._generation:
                raise LoadFailed("not sent: the engine's namespace changed since it was planned")
            return call(client, ns)

        return if_current

    def _check_awake(self) -> None:
        if self._asleep:
            raise LoadFailed("not copied: the engine is asleep (its KV cache unmapped)")

    @property
    def _gpu_kv(self) -> GpuKV | None:
        return None if self.kv is None or isinstance(self.kv, LayerMajorKV) else self.kv

    # ------------------------------------------------------------------ loads

    def start_loads(self, jobs: list[LoadJob]) -> None:
        """Every job gets a Future, so every waiting request is answered (loaded or failed). The loads
        write blocks vLLM allocated afresh for them: stores still reading those end first (`fence`)."""
        self.fence({block for job in jobs for block in job.block_ids})
        for job in jobs:
            call = DeviceCall.due_in(self.load_delay_s + self.link.timeout)  # (the test delay comes first)
            try:
                if self._disabled or self.kv is None:
                    raise LoadFailed(self._disabled or "no KV cache registered")
                self._check_awake()
                keys = LoadJob(job.req_id, job.block_ids, keyed(job.hashes, self._key_suffix))
                load = self._while_current(lambda client, ns, job=keys, call=call: self._load(client, ns, job, call))
                call.future = self.link.submit(load)
            except Exception as exc:  # noqa: BLE001
                call.future = _failed_future(str(exc))
            self._loads[job.req_id] = job, call

    def _load(self, client: KVTierClient, ns: Namespace, job: LoadJob, call: DeviceCall) -> int | _Pinned:
        """On the link thread: bytes loaded (GPU caches: copied and checked here), or the pinned blocks
        a CPU cache copies on the engine's own thread (`finished_loads`). A CPU copy here would run
        many numpy calls, each waiting for the GIL that the engine's busy loop holds: several times
        slower than the same copy between two steps."""
        if self.load_delay_s:
            time.sleep(self.load_delay_s)
        if ns.cuda_registration:
            loaded = call.run(partial(client.load_cuda, ns, job.block_ids, job.hashes, 0), daemon_copies=True)
            if loaded < len(job.hashes):
                raise LoadFailed(f"{len(job.hashes) - loaded} of {len(job.hashes)} blocks gone since lookup")
            return loaded * ns.block_bytes
        return call.run(lambda deadline_ns: self._load_from_pool(client, ns, job, call), daemon_copies=False)

    def _load_from_pool(self, client: KVTierClient, ns: Namespace, job: LoadJob, call: DeviceCall) -> int | _Pinned:
        """Pin the blocks; a GPU cache copies them here (in runs of at most the daemon's
        max_batch_blocks), a CPU cache on the engine's thread. Nothing is copied or handed on past
        the deadline (by its grace after it the load is given up, and its blocks may be reused)."""
        if self._gpu_kv is not None:
            limit = client.state.max_batch_blocks
            for start in range(0, len(job.hashes), limit):
                end = start + limit
                self._copy_from_pool(client, ns, job.hashes[start:end], job.block_ids[start:end], call)
            return len(job.block_ids) * ns.block_bytes
        result = client.lookup(ns, job.hashes, pin=True)
        if result.hit_count == len(job.hashes) and time.monotonic_ns() < call.deadline_ns:
            return _Pinned(result, client.state.pool().view, client)  # released once the engine thread copied
        if result.lease_id:
            client.release(result.lease_id)
        raise _unusable(result, job.hashes)

    def _copy_from_pool(
        self, client: KVTierClient, ns: Namespace, hashes: list[bytes], block_ids: list[int], call: DeviceCall
    ) -> None:
        result = client.lookup(ns, hashes, pin=True)
        try:
            with call.engine_copy():  # (counted before the deadline is checked: the engine thread sees one or the other)
                if result.hit_count < len(hashes) or time.monotonic_ns() >= call.deadline_ns:
                    raise _unusable(result, hashes)
                copied = self._gpu_kv.from_pool(client.state.pool(), result.page_ids, block_ids)
        finally:
            if result.lease_id:
                client.release(result.lease_id)
        if checksum.mismatched(copied, result.checksums).any():
            raise LoadFailed("a block failed its checksum")

    def _copy_pinned(self, job: LoadJob, pinned: _Pinned) -> int:
        """On the engine's thread, between steps: copy pinned pool blocks into the engine's blocks."""
        try:
            copied = self.kv.read_pool(pinned.view, pinned.result.page_ids, job.block_ids)
        finally:
            self.link.submit(partial(_release_if_held_by, pinned))
        if checksum.mismatched(copied, pinned.result.checksums).any():
            raise LoadFailed("a block failed its checksum")
        return len(job.block_ids) * self.kv.block_bytes

    def finished_loads(self) -> tuple[set[str], set[str]]:
        """(finished, failed) request ids; failed ones are in both."""
        finished, failed = set(), set()
        for req_id, (job, call) in list(self._loads.items()):
            if not call.settled():
                continue
            del self._loads[req_id]
            finished.add(req_id)
            try:
                if not call.future.done():  # (should it run later, it copies nothing: past its deadline)
                    raise LoadFailed("no answer by its deadline")
                error = call_error(call.future)
                if error is not None:
                    raise LoadFailed(str(error) or type(error).__name__)
                loaded = call.future.result()
                if isinstance(loaded, _Pinned):
                    loaded = self._copy_pinned(job, loaded)
            except Exception as exc:  # noqa: BLE001 (any failure, DaemonUnavailable or LoadFailed included, means recompute)
                failed.add(req_id)
                with self._lock:
                    self.stats.load_failures += 1
                reason = str(exc)  # (not the error: a record kept by a handler would keep its frames, this one's)
                log.warning("kvtier load for request %s failed (%s); recomputing", req_id, reason)
                continue
            with self._lock:
                self.stats.loaded_blocks += loaded // self.kv.block_bytes
                self.stats.loaded_bytes += loaded
        return finished, failed

    # ------------------------------------------------------------------ stores

    def save(self, jobs: list[StoreJob]) -> None:
        """Called after the step's forward: store the blocks it completed."""
        block_ids = [b for job in jobs for b in job.block_ids]
        if not block_ids or self._disabled or self.kv is None:
            return
        if self._asleep:
            self.stats.store_skipped_blocks += len(block_ids)
            return
        if self._gpu_kv is not None:  # the daemon (cuda_ipc) or our kernel (shm) reads the blocks after this step
            with self._lock:  # (a slow daemon must not hold ever more finished requests' blocks)
                if self._pending_gpu_stores >= MAX_PENDING_GPU_STORES or not self.link.available:
                    self.stats.store_skipped_blocks += len(block_ids)
                    return
                self._pending_gpu_stores += 1
            try:
                self._submit_gpu_store(jobs, self._gpu_kv.record_ready())
            except BaseException:
                with self._lock:
                    self._pending_gpu_stores -= 1
                raise
            return
        size = len(block_ids) * self.kv.block_bytes
        with self._lock:
            if self._pending_store_bytes + size > self.max_pending_store_bytes or not self.link.available:
                self.stats.store_skipped_blocks += len(block_ids)
                return
            self._pending_store_bytes += size
        layers = self.kv.snapshot(block_ids)
        hashes = keyed([h for job in jobs for h in job.hashes], self._key_suffix)
        future = self.link.submit(self._while_current(lambda client, ns: self._store(client, ns, hashes, layers)))
        future.add_done_callback(lambda f: self._stored(f, size, len(block_ids)))

    def _submit_gpu_store(self, jobs: list[StoreJob], ready: int) -> None:
        """One store call for the jobs (a step's), after the ring's ready event `ready` (the fence
        waits for it before vLLM writes any of its blocks again)."""
        block_ids = [b for job in jobs for b in job.block_ids]
        hashes = keyed([h for job in jobs for h in job.hashes], self._key_suffix)
        call = DeviceCall.due_in(self.link.timeout)
        call.store_jobs, call.ready, call.generation = jobs, ready, self._generation
        store = self._while_current(lambda client, ns: self._store_gpu(client, ns, hashes, block_ids, ready, call))
        call.future = self.link.submit(store)
        call.future.add_done_callback(lambda f: self._stored(f, 0, len(block_ids), gpu_call=True))
        self._gpu_stores = [held for held in self._gpu_stores if not held.settled()] + [call]

    def _store_gpu(  # noqa: PLR0913
        self, client: KVTierClient, ns: Namespace, hashes: list[bytes], block_ids: list[int], ready: int, call: DeviceCall
    ) -> int:
        """Store the blocks the forward marked by the ring's ready event `ready` wrote."""
        if ns.cuda_registration:
            return call.run(lambda deadline_ns: client.store_cuda(ns, hashes, block_ids, ready, deadline_ns), daemon_copies=True)

        def write(reservation: Reservation) -> np.ndarray:  # as the daemon does: nothing read past the deadline
            chosen = [block_ids[i] for i in reservation.reserved_indices.tolist()]
            if time.monotonic_ns() >= call.deadline_ns:
                raise PastDeadline("not copied: the store's deadline passed")
            sums = self._gpu_kv.to_pool(client.state.pool(), reservation.page_ids, chosen, ready)
            if time.monotonic_ns() > call.deadline_ns:
                raise PastDeadline("not committed: the copy ended after the store's deadline")
            return sums

        return call.run(lambda deadline_ns: _reserve_write_commit(client, ns, hashes, write), daemon_copies=False)

    def _store(self, client: KVTierClient, ns: Namespace, hashes: list[bytes], layers: list[np.ndarray]) -> int:
        def write(reservation: Reservation) -> np.ndarray:
            chosen = reservation.reserved_indices
            rows = layers if len(chosen) == len(hashes) else [layer[chosen] for layer in layers]
            return self.kv.write_pool(client.state.pool().view, reservation.page_ids, rows)

        return _reserve_write_commit(client, ns, hashes, write)

    def _stored(self, future: Future, size: int, blocks: int, gpu_call: bool = False) -> None:
        if future.cancelled():  # (withdrawn by the fence, which counts its blocks, or past its deadline)
            with self._lock:
                self._pending_store_bytes -= size
                self._pending_gpu_stores -= gpu_call
            return
        error = call_error(future)  # (a failed store only costs a future miss)
        stored = future.result() if error is None else 0
        with self._lock:
            self._pending_store_bytes -= size
            self._pending_gpu_stores -= gpu_call
            if error is not None:
                self.stats.store_failures += blocks
            self.stats.stored_blocks += stored
            self.stats.stored_bytes += stored * self.kv.block_bytes
        if error is not None:
            log.debug("kvtier store failed: %s", error)

    def fence(self, fresh_blocks: set[int] | None) -> None:
        """vLLM is about to write these blocks (None: any block), allocated afresh for the step (its
        forward or its loads write them): store calls that still read any of them (stores of requests
        finished or preempted since, whose blocks vLLM freed at once) are withdrawn if not yet sent,
        and the ones under way are awaited until they hold the blocks no more (at the latest their
        deadline and CUDA_ANSWER_GRACE_S; nothing is copied or committed past the deadline). A step's
        store call carries every request of the step: the jobs of a withdrawn one that read none of
        these blocks are sent again (after the same ready event), unless the engine adopted another
        namespace since the call was planned."""

        def reads_fresh(job: StoreJob) -> bool:
            return fresh_blocks is None or not fresh_blocks.isdisjoint(job.block_ids)

        self._gpu_stores = [call for call in self._gpu_stores if not call.settled()]
        under_way, resend = [], []
        for call in [call for call in self._gpu_stores if any(map(reads_fresh, call.store_jobs))]:
            if not call.future.cancel():  # (cancel() works for calls still queued: nothing read yet)
                under_way.append(call)
                continue
            self._gpu_stores = [held for held in self._gpu_stores if held is not call]
            current = call.generation == self._generation  # (else its jobs would go into another namespace)
            others = [job for job in call.store_jobs if not reads_fresh(job)] if current else []
            with self._lock:
                self.stats.store_skipped_blocks += sum(len(job.block_ids) for job in call.store_jobs) - sum(
                    len(job.block_ids) for job in others
                )
            if others:
                resend.append((others, call.ready))
        if under_way:
            latest_ns = max(call.hold_end_ns for call in under_way)
            wait_futures([call.future for call in under_way], timeout=max(0.0, (latest_ns - time.monotonic_ns()) / 1e9))
            held_ns = max(call.held_until_ns() for call in under_way) - time.monotonic_ns()
            if held_ns > 0:
                time.sleep(held_ns / 1e9)
        for jobs, ready in resend:  # (once nothing reads the fresh blocks: a failure here cannot skip that)
            self._send_again(jobs, ready)

    def _send_again(self, jobs: list[StoreJob], ready: int) -> None:
        with self._lock:
            self._pending_gpu_stores += 1
        try:
            self._submit_gpu_store(jobs, ready)
        except Exception:  # noqa: BLE001 (the link closing, say: the blocks are lost, as a skipped store's)
            with self._lock:
                self._pending_gpu_stores -= 1
                self.stats.store_skipped_blocks += sum(len(job.block_ids) for job in jobs)
            log.debug("kvtier store not sent again", exc_info=True)

    def take_stats(self) -> WorkerStats:
        with self._lock:
            stats, self.stats = self.stats, WorkerStats()
        return stats


def _reserve_write_commit(
    client: KVTierClient, ns: Namespace, hashes: list[bytes], write: Callable[[Reservation], np.ndarray]
) -> int:
    """Reserve `hashes`, let `write` fill the reserved blocks (returning their checksums), commit;
    abort if the write or the commit fails (a commit lost on its way would otherwise hold its pages
    until the daemon's --lease-ttl). Returns how many blocks were committed. Many hashes go in runs of at
    most the daemon's max_batch_blocks, one reservation each; the Reservation `write` gets has a
    status for each of `hashes` (those outside its run PRESENT), so its reserved_indices index them."""
    committed, limit = 0, client.state.max_batch_blocks
    for start in range(0, len(hashes), limit):
        run = client.reserve(ns, hashes[start : start + limit])
        if not run.id:
            continue
        statuses = np.full(len(hashes), pb.BLOCK_STATUS_PRESENT, dtype=np.uint8)
        statuses[start : start + len(run.statuses)] = run.statuses
        try:
            sums = write(Reservation(run.id, statuses, run.page_ids))
            committed += client.commit(run.id, checksums=sums)
        except BaseException:
            with contextlib.suppress(Exception):  # (committed after all, or the daemon gone: nothing to abort)
                client.abort(run.id)
            raise
    return committed


def _unusable(result: LookupResult, hashes: list[bytes]) -> Exception:
    """Why pinned blocks are not copied: some gone since the lookup, or else the deadline passed."""
    if result.hit_count < len(hashes):
        return LoadFailed(f"{len(hashes) - result.hit_count} of {len(hashes)} blocks gone since lookup")
    return PastDeadline("not copied: the load's deadline passed")


def _failed_future(reason: str) -> Future:
    future: Future = Future()
    future.set_exception(LoadFailed(reason))
    return future
