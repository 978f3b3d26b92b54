"""The daemon side of TRANSPORT_CUDA_IPC: engines' GPU KV caches, opened once, and the copies.

A registration belongs to a session: the engine worker's KV cache allocations opened through CUDA
IPC on the device with the same UUID, its layout (gpu_copy.GpuLayout: the segment template, kept on
that GPU), and its ring of ready events. The
daemon keeps one CUDA context per GPU (torch's primary context) and LANES_PER_DEVICE copy lanes per
GPU, taken in turn (gpu_copy.CopyLane: a stream for the copy engines and one for the kernel). The
event loop enqueues each copy itself (a few hundred microseconds of numpy and launches: no thread
hand-off before the bytes start moving) and watches it by hybrid polling, as the kernel's block
layer does for fast disks: it sleeps until shortly before the copy can have ended (`LinkClock`),
then checks the copy's event on every turn of the loop, serving other calls in between, until it
is done. No thread wakes up and no lock changes hands between the last byte and the caller, which
goes on the moment the copy is seen done (a load answers from there); the cost is the loop
spinning from about a millisecond before the copy can have ended (uvloop's timers count whole
milliseconds) until it is seen done.
A store's copy is enqueued once the ready event it names (the one its engine recorded after the
forward that wrote its blocks) is seen complete from the host (`_engine_ready`): the engine's stream
never waits for a store, and none of the daemon's streams ever waits for an engine's work, so no
copy lane (shared by every engine on the GPU), no closing of another engine's mappings (which
synchronizes the device) and no shutdown waits for one engine's forward. Loads return only when the
bytes are in the engine's memory. A copy whose launch fails
after part of it went to the GPU (gpu_copy's LaunchFailed) is watched the same way until that part
has landed, and only then does its error go up (and its pages go free). When a session ends, its
registrations close after their copies in flight finish, which closes the IPC mappings (the GPU
memory of an engine that died is then freed).
Deadlines: a call may name the moment (the host's CLOCK_MONOTONIC) after which its engine stops
waiting for the answer and may reuse the blocks. No copy starts that the LinkClock says cannot end
by then; the data service commits no store seen ending after it. An engine whose clock is not the
daemon's (a time namespace) is refused at registration, since its deadlines would mean other moments.
"""

from __future__ import annotations

import asyncio
import ctypes
import functools
import itertools
import logging
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvtier.copy_plan import WORD, LaunchFailed, Run, SegmentTemplate
from kvtier.v1 import kvtier_pb2 as pb
from kvtierd.errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, NotFound, PermissionDenied

log = logging.getLogger("kvtierd.gpu")

LANES_PER_DEVICE = 4  # copies in flight per GPU before they queue behind each other
LINK_BYTES_PER_S = 55e9  # the least a GPU's link is taken to move (PCIe Gen5 x16); a faster one is measured
LINK_MARGIN = 1.02  # a measured link is taken to move this much faster (a copy is never expected after its end)
LINK_PROBE_BYTES = 64 << 20  # each way, three times, when a GPU gets its first registration
POLL_EARLY_S = 0.001  # polling starts this long before (uvloop's timers count whole milliseconds)
FAST_POLL_S = 0.002  # then every turn of the loop until this long past the expected end, then
SLOW_POLL_S = 0.001  # every this long (a copy slower than expected: another GPU generation, contention)
READY_SPIN_S = 0.0002  # a store's ready event is checked on every turn of the loop this long, then every SLOW_POLL_S
MAX_READY_EVENTS = 256  # bound on an engine's ring of ready events
MAX_FIELD = 1 << 48  # bound on every offset, stride and size an engine sends (256 TiB)
MAX_RUNS = 1024  # bound on a block's runs (vLLM: one or two per layer; each a copy segment or more) and on allocations
IPC_HANDLE_BYTES = 64  # a cudaIpcMemHandle_t / cudaIpcEventHandle_t: torch reads this many, whatever it is given
REF_COUNTER_NAME = re.compile(r"/torch_[0-9]+_[0-9]+(_[0-9]+)?")  # torch's shared-memory ref counter files
REF_COUNTER_SLOTS = 10000  # torch's CUDA_IPC_REF_COUNTER_FILE_SIZE: the slots of an IPC ref counter file
MAX_ENGINE_CLOCK_AHEAD_NS = 1_000_000_000  # an engine clock further ahead of ours makes its deadlines late
MAX_ENGINE_CLOCK_BEHIND_NS = 5_000_000_000  # one further behind (beyond a Register's transit): its copies refused


@dataclass
class CudaRegistration:
    id: str
    session_id: str
    namespace_id: str  # the namespace it was registered with: its block size and pages fit only that one
    device_index: int
    storages: list  # torch.UntypedStorage opened through CUDA IPC
    layout: object  # gpu_copy.GpuLayout over the storages
    num_blocks: int
    ready_events: list  # torch.cuda.Events opened from the engine's ring of handles
    handles: tuple = ()  # its allocations' IPC handles: which KV cache it is
    in_flight: int = 0
    closing: bool = False
    closed: asyncio.Event = field(default_factory=asyncio.Event)

    def check_blocks(self, block_ids: np.ndarray, distinct: bool = False) -> None:
        """In range; `distinct` for a load (two copies into one block would fail its check in place,
        and the good pool block be dropped as corrupt)."""
        if len(block_ids) and (block_ids.min() < 0 or block_ids.max() >= self.num_blocks):
            raise InvalidArgument(f"device block ids must be in [0, {self.num_blocks})")
        if distinct and len(block_ids) > 1 and len(np.unique(block_ids)) != len(block_ids):
            raise InvalidArgument("a load's device block ids must be distinct")

    def ready_event(self, index: int):
        """The ring's event `index` (a store names the one recorded after the forward it follows)."""
        if index >= len(self.ready_events):
            raise InvalidArgument(f"ready_event {index} is outside the registration's ring of {len(self.ready_events)}")
        return self.ready_events[index]


@dataclass
class GpuTransfers:
    pool_address: int
    page_size: int
    pool_registered: bool
    kernel_error: str = ""  # why the copy kernel failed to compile at start-up (cuda_ipc is then refused)
    _registrations: dict[str, CudaRegistration] = field(default_factory=dict)
    _clock: LinkClock = field(default_factory=lambda: LinkClock())
    _lanes: dict[int, list] = field(default_factory=dict)  # per GPU: its gpu_copy.CopyLanes
    _next_lane: dict[int, itertools.cycle] = field(default_factory=dict)  # per GPU: its lanes, in turn

    # ------------------------------------------------------------------ registration

    def register(  # noqa: PLR0913
        self, session_id: str, cache: pb.CudaKVCache, namespace_id: str, block_bytes: int, engine_clock_ns: int
    ) -> CudaRegistration:
        """Open an engine worker's KV cache for one namespace; raises InvalidArgument for a malformed
        description and FailedPrecondition when this daemon cannot (no CUDA, pool not registered,
        another GPU, another clock). Everything the engine sends is checked before the first CUDA call.
        (Opening the handles holds the event loop for a few ms: lookups of another engine meanwhile
        took at most 5.7 ms on the H200.)
        `engine_clock_ns` is the engine's CLOCK_MONOTONIC when it sent the request."""
        runs = _checked_runs(cache, block_bytes)
        try:
            template = SegmentTemplate.build(runs, self.page_size)
        except ValueError as exc:
            raise InvalidArgument(str(exc)) from None
        _check_clock(engine_clock_ns)
        if self.kernel_error:
            raise FailedPrecondition(f"the copy kernel did not compile: {self.kernel_error}")
        if not self.pool_registered:
            raise FailedPrecondition("the pool is not registered with CUDA (no CUDA runtime, or --cuda-register false)")
        torch = _cuda_torch()
        device_index = _device_by_uuid(torch, cache.device_uuid)
        storages, ready = _open_cache(torch, device_index, cache)
        with torch.cuda.device(device_index):
            from kvtier.gpu_copy import CopyLane, GpuLayout  # noqa: PLC0415 (needs triton)

            bases = np.array([s.data_ptr() for s in storages], dtype=np.int64)
            layout = GpuLayout.on(template, bases, self.page_size, torch.device("cuda", device_index))
            if device_index not in self._lanes:  # (before the registration is kept: this may fail too)
                device = torch.device("cuda", device_index)
                lanes = [CopyLane.on(device) for _ in range(LANES_PER_DEVICE)]
                rate = self._clock.rates[device] = max(LINK_BYTES_PER_S, LINK_MARGIN * _link_bytes_per_s(torch, device))
                self._lanes[device_index] = lanes
                self._next_lane[device_index] = itertools.cycle(lanes)
                log.info("cuda_ipc link measured", extra={"device": device_index, "GBps": round(rate / 1e9, 1)})
        registration = CudaRegistration(
            id=uuid.uuid4().hex,
            session_id=session_id,
            namespace_id=namespace_id,
            device_index=device_index,
            storages=storages,
            layout=layout,
            num_blocks=cache.num_blocks,
            ready_events=ready,
            handles=tuple(a.ipc_handle for a in cache.allocations),
        )
        for earlier in [r for r in self._registrations.values() if self._superseded(r, registration)]:
            self._retire(earlier)  # mappings do not pile up until the session ends
        self._registrations[registration.id] = registration
        log.info(
            "cuda_ipc registered",
            extra={
                "session": session_id,
                "registration": registration.id,
                "device": device_index,
                "segments": len(template.words),
            },
        )
        return registration

    @staticmethod
    def _superseded(earlier: CudaRegistration, new: CudaRegistration) -> bool:
        """A session's registration of a namespace, or of the same KV cache, goes when the session
        registers it again (the connector moves its cache to a new namespace when vLLM resets its
        prefix cache)."""
        same = earlier.namespace_id == new.namespace_id or earlier.handles == new.handles
        return earlier.session_id == new.session_id and same

    def registration(self, session_id: str, registration_id: str, namespace_id: str) -> CudaRegistration:
        registration = self._registrations.get(registration_id)
        if registration is None or registration.closing:
            raise NotFound(f"cuda registration {registration_id!r} is unknown (register again after a reconnect)")
        if registration.session_id != session_id:
            raise PermissionDenied(f"cuda registration {registration_id!r} belongs to another session")
        if registration.namespace_id != namespace_id:
            raise InvalidArgument(
                f"cuda registration {registration_id!r} is for namespace {registration.namespace_id}, not {namespace_id}"
            )
        return registration

    # ------------------------------------------------------------------ copies

    async def store(  # noqa: PLR0913
        self, registration: CudaRegistration, block_ids: np.ndarray, page_ids: np.ndarray, ready_event, deadline_ns: int = 0
    ) -> np.ndarray:
        """Copy engine blocks into pool blocks once the engine's `ready_event` (one of its ring:
        `registration.ready_event(index)`) has completed; their checksums."""
        return await self._run(registration, block_ids, page_ids, after=ready_event, deadline_ns=deadline_ns)

    async def load(  # noqa: PLR0913
        self,
        registration: CudaRegistration,
        block_ids: np.ndarray,
        page_ids: np.ndarray,
        deadline_ns: int = 0,
        meanwhile: Callable[[], None] | None = None,
    ) -> np.ndarray:
        """Copy pool blocks into engine blocks; the checksums of what was copied, as soon as the bytes
        are seen in place. `meanwhile` runs once the copy is enqueued, while its bytes move (the
        caller's work that need not hold up their start)."""
        return await self._run(registration, block_ids, page_ids, after=None, deadline_ns=deadline_ns, meanwhile=meanwhile)

    async def _run(  # noqa: PLR0913
        self,
        registration: CudaRegistration,
        block_ids: np.ndarray,
        page_ids: np.ndarray,
        after,
        deadline_ns: int,
        meanwhile: Callable[[], None] | None = None,
    ):
        """Enqueue the copy (a store, into the pool, once the engine's event `after` has completed; a
        load when `after` is None), run `meanwhile`, and poll the copy (see the module's notes); the
        registration stays open until it has ended, whatever `meanwhile` raised. A copy that cannot
        end by `deadline_ns` (0: none) is not started."""
        to_pool = after is not None
        if registration.closing:  # its session ended while the call waited (e.g. for a disk read)
            raise NotFound(f"cuda registration {registration.id!r} closed with its session")
        registration.in_flight += 1
        try:
            if to_pool:
                await _engine_ready(registration, after, deadline_ns)
                if registration.closing:  # (its forward ended in the turn the session or the daemon ended)
                    raise FailedPrecondition("the engine's session ended before its blocks were copied; nothing was copied")
            lane = next(self._next_lane[registration.device_index])
            now = asyncio.get_running_loop().time()
            end = self._clock.expected_end(now, lane, to_pool, len(block_ids) * registration.layout.block_bytes)
            if deadline_ns and time.monotonic_ns() + (end - now) * 1e9 > deadline_ns:
                raise DeadlineExceeded("the copy could not end by the call's deadline; nothing was copied")
            try:
                launched = self._launch(registration, lane, block_ids, page_ids, to_pool)
            except LaunchFailed as failed:  # what went to the GPU lands before the pages are freed
                await _landed(failed.enqueued, asyncio.get_running_loop().time())
                raise
            self._clock.book(lane, to_pool, end)
            try:
                if meanwhile is not None:
                    meanwhile()
            finally:
                await _landed(launched, end)
            return launched.checksums()
        finally:
            registration.in_flight -= 1
            if registration.closing and registration.in_flight == 0:
                self._close(registration)

    def _launch(self, registration: CudaRegistration, lane, block_ids: np.ndarray, page_ids: np.ndarray, to_pool: bool):
        from kvtier.gpu_copy import launch_copy  # noqa: PLC0415 (needs triton)

        return launch_copy(registration.layout, block_ids, self.pool_address, page_ids, to_pool, lane)

    # ------------------------------------------------------------------ teardown

    async def close_session(self, session_id: str) -> int:
        """Close the session's registrations, each as soon as its copies in flight end, and return
        once all are closed (the pool pages those copies used may then be freed)."""
        mine = [r for r in self._registrations.values() if r.session_id == session_id]
        for registration in mine:
            self._retire(registration)
        await asyncio.gather(*(r.closed.wait() for r in mine))
        return len(mine)

    def _retire(self, registration: CudaRegistration) -> None:
        """No new copy for it; closed now, or by its last copy in flight."""
        registration.closing = True
        if registration.in_flight == 0:
            self._close(registration)

    def _close(self, registration: CudaRegistration) -> None:
        """No copy of it is in flight (each call goes on only once its copy is seen done): dropping the
        storages closes the IPC mappings. A call that still holds the registration finds it closing."""
        registration.closing = True
        self._registrations.pop(registration.id, None)
        registration.storages.clear()
        registration.ready_events.clear()
        registration.closed.set()
        log.info("cuda_ipc closed", extra={"session": registration.session_id, "registration": registration.id})

    def warm_up(self) -> None:
        """Import torch and triton and compile the copy kernel now (seconds), not in the first engine's
        Register or on the event loop in its first copy."""
        try:
            _cuda_torch()
        except FailedPrecondition as exc:
            log.info("cuda_ipc unavailable", extra={"reason": str(exc)})
            return
        from kvtier.gpu_copy import compile_kernel  # noqa: PLC0415 (needs triton)

        try:
            compile_kernel()
        except Exception as exc:  # noqa: BLE001 (the shm transport still serves every engine)
            self.kernel_error = str(exc)
            log.error("cuda_ipc unavailable: the copy kernel did not compile", extra={"reason": self.kernel_error})

    def close(self) -> None:
        """Copies whose callers went with the event loop land before the mappings go (only the lanes
        are waited for: nothing else of the device is ours). A registration with a call still under
        way (a store waiting for its engine's forward) closes when that call ends, launching nothing."""
        for lanes in self._lanes.values():
            for lane in lanes:
                lane.dma.synchronize()
                lane.kernel.synchronize()
        for registration in list(self._registrations.values()):
            self._retire(registration)


@dataclass
class LinkClock:
    """The soonest each copy can end, in the event loop's time. A lane's copies run one after another
    (its streams). Copies on a GPU's other lanes in the same direction share its link with it: at
    the link's rate (`rates`, per device: measured when the GPU gets its first registration, at least
    LINK_BYTES_PER_S) shared fairly, each of them moves min(its remaining bytes, this copy's size)
    before this one ends (processor sharing). The copy engines rather run copies of different streams
    one after another (measured on an H200): for copies started together the estimates are their
    ends, but a small copy started while a large one moves is expected too soon. It is then polled
    for until it lands, and its deadline check was as much too lenient: milliseconds, against the
    engine's CUDA_ANSWER_GRACE_S of seconds."""

    rates: dict = field(default_factory=dict)  # device -> the most bytes per second its link moves each way
    _lane_end: dict = field(default_factory=dict)  # lane -> end of its last copy
    _direction_ends: dict = field(default_factory=dict)  # (device, to pool) -> {lane: end of its last copy}

    def expected_end(self, now: float, lane, to_pool: bool, size: int) -> float:
        """When a copy of `size` bytes started on `lane` now could end (`book` it once started)."""
        rate = self.rates.get(lane.device, LINK_BYTES_PER_S)
        start = max(now, self._lane_end.get(lane, now))
        sharing = self._direction_ends.get((lane.device, to_pool), {})
        shared = sum(min(size, (end - start) * rate) for other, end in sharing.items() if other != lane and end > start)
        return start + (size + shared) / rate

    def book(self, lane, to_pool: bool, end: float) -> None:
        """A copy ending at `end` was started on `lane`."""
        self._lane_end[lane] = self._direction_ends.setdefault((lane.device, to_pool), {})[lane] = end


def _link_bytes_per_s(torch, device) -> float:
    """The fastest of three pinned copies of LINK_PROBE_BYTES each way between host and `device`
    (faster links than PCIe Gen5, such as NVLink-C2C, would otherwise be waited on as if they were).
    The probe's GPU memory goes back to the device afterwards, not into torch's cache. Without room
    for it (a GPU the engines filled), LINK_BYTES_PER_S: the registration goes on."""
    try:
        fastest = max(_probe_copy_rates(torch, device))
    except RuntimeError as exc:  # (torch.OutOfMemoryError among them)
        log.warning("cuda_ipc link not measured; taken as PCIe Gen5", extra={"device": str(device), "reason": str(exc)})
        fastest = LINK_BYTES_PER_S
    torch.cuda.empty_cache()  # (once the probe's tensors are gone with its frame)
    return fastest


def _probe_copy_rates(torch, device) -> list[float]:
    host = torch.empty(LINK_PROBE_BYTES, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(LINK_PROBE_BYTES, dtype=torch.uint8, device=device)
    stream, rates = torch.cuda.Stream(device), []
    with torch.cuda.stream(stream):
        for dst, src in [(gpu, host), (host, gpu)] * 3:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(stream)
            dst.copy_(src, non_blocking=True)
            end.record(stream)
            end.synchronize()
            rates.append(LINK_PROBE_BYTES / (start.elapsed_time(end) / 1000))
    return rates


async def _engine_ready(registration: CudaRegistration, event, deadline_ns: int) -> None:
    """Wait until the engine's ready `event` has completed: checked on every turn of the loop for
    READY_SPIN_S (a store sent right after its forward's record), then every SLOW_POLL_S. Only the
    host queries it, so a forward that never ends holds this call alone, until its deadline. The
    engine records the ring's events in turn, so by the time this one is recorded again its forward
    has long ended (a later record of it is waited for too, and ends soon after)."""
    loop = asyncio.get_running_loop()
    spin_until = loop.time() + READY_SPIN_S
    while not event.query():
        if registration.closing:
            raise FailedPrecondition("the engine's session ended before its blocks were ready; nothing was copied")
        if deadline_ns and time.monotonic_ns() > deadline_ns:
            raise DeadlineExceeded("the engine's blocks were not ready by the call's deadline; nothing was copied")
        await asyncio.sleep(0 if loop.time() < spin_until else SLOW_POLL_S)


async def _landed(launched, expected_end: float) -> None:
    """Sleep until shortly before `expected_end`, then poll the copy on every turn of the loop (for up
    to FAST_POLL_S past it), then every SLOW_POLL_S, until it is done. It polls in the caller's own
    task (the caller goes on in the turn that sees the copy done); a cancellation meanwhile (the
    caller's deadline) is held back until then, because the copy still owns its pages."""
    loop = asyncio.get_running_loop()
    cancelled = False
    if expected_end - POLL_EARLY_S > loop.time():
        try:
            await asyncio.sleep(expected_end - POLL_EARLY_S - loop.time())
        except asyncio.CancelledError:
            cancelled = True
    fast_until = max(loop.time(), expected_end) + FAST_POLL_S
    while not launched.finished():
        try:
            await asyncio.sleep(0 if loop.time() < fast_until else SLOW_POLL_S)
        except asyncio.CancelledError:
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError


def _cuda_torch():
    try:
        import torch  # noqa: PLC0415

        import kvtier.gpu_copy  # noqa: F401, PLC0415 (triton)
    except ImportError as exc:
        raise FailedPrecondition(f"this daemon cannot serve cuda_ipc: {exc}") from None
    if not torch.cuda.is_available():
        raise FailedPrecondition("this daemon has no CUDA device")
    return torch


def _checked_runs(cache: pb.CudaKVCache, block_bytes: int) -> list[Run]:
    """The cache's runs, once every number in it is in bounds: runs within their allocations, adding
    up to the namespace's block, blocks of a run not overlapping; each allocation 8-byte aligned
    (the kernel moves aligned words: a misaligned one faults our CUDA context, for every engine)
    with whole IPC handles and a ref counter slot within a torch ref counter file."""
    if not cache.allocations or not cache.runs or cache.num_blocks == 0:
        raise InvalidArgument("cuda_kv needs allocations, runs and num_blocks")
    if len(cache.runs) > MAX_RUNS or len(cache.allocations) > MAX_RUNS:
        counts = f"{len(cache.runs)} runs per block and {len(cache.allocations)} allocations"
        raise InvalidArgument(f"cuda_kv has {counts}; at most {MAX_RUNS} each")
    if not cache.ready_events or len(cache.ready_events) > MAX_READY_EVENTS:
        raise InvalidArgument(f"cuda_kv needs the engine's ring of 1 to {MAX_READY_EVENTS} ready events (stores wait on them)")
    for allocation in cache.allocations:
        if max(allocation.size_bytes, allocation.offset) >= MAX_FIELD:
            raise InvalidArgument(f"allocation sizes and offsets must be below {MAX_FIELD}")
        if allocation.offset % WORD:
            raise InvalidArgument(f"allocation offsets must be multiples of {WORD}")
        if len(allocation.ipc_handle) < IPC_HANDLE_BYTES or 0 < len(allocation.event_handle) < IPC_HANDLE_BYTES:
            raise InvalidArgument(f"IPC handles must hold {IPC_HANDLE_BYTES} bytes")
        if allocation.ref_counter_offset >= REF_COUNTER_SLOTS:
            raise InvalidArgument(f"ref_counter_offset must be below {REF_COUNTER_SLOTS}")
        if not REF_COUNTER_NAME.fullmatch(allocation.ref_counter_handle.decode(errors="replace")):
            raise InvalidArgument("ref_counter_handle must name a torch ref counter file (/torch_<pid>_<n>...)")
    runs = [Run(r.allocation, r.offset, r.block_stride, r.size_bytes) for r in cache.runs]
    if any(max(r.offset, r.block_stride, r.size) >= MAX_FIELD for r in runs):
        raise InvalidArgument(f"run offsets, strides and sizes must be below {MAX_FIELD}")
    if sum(r.size for r in runs) != block_bytes:
        raise InvalidArgument(f"cuda_kv runs hold {sum(r.size for r in runs)} bytes per block; the namespace says {block_bytes}")
    for run in runs:
        if cache.num_blocks > 1 and run.block_stride < run.size:
            raise InvalidArgument(f"run {run}: its blocks overlap (stride below size)")
        if run.allocation >= len(cache.allocations):
            raise InvalidArgument(f"run {run} names allocation {run.allocation} of {len(cache.allocations)}")
        end = run.offset + (cache.num_blocks - 1) * run.block_stride + run.size
        if end > cache.allocations[run.allocation].size_bytes:
            raise InvalidArgument(f"run {run} reaches byte {end}, beyond its allocation")
    _check_runs_apart(cache, runs)
    return runs


def _check_runs_apart(cache: pb.CudaKVCache, runs: list[Run]) -> None:
    """No two runs share a byte in any two blocks: two copies into one engine byte would fail a good
    block's check in place (allocations with one IPC handle are one memory, at their offsets). Runs
    whose stretches over all blocks meet must interleave: one block stride, and within it windows
    that do not meet (a layout with K and V of a block side by side). Runs are bounded (MAX_RUNS,
    their ends by their allocations' sizes): their pairs are compared at once."""
    if len(runs) < 2:
        return
    handles = {a.ipc_handle: i for i, a in enumerate(cache.allocations)}
    memory = np.array([handles[cache.allocations[r.allocation].ipc_handle] for r in runs])
    start = np.array([cache.allocations[r.allocation].offset + r.offset for r in runs], dtype=np.int64)
    stride = np.array([r.block_stride for r in runs], dtype=np.int64)
    size = np.array([r.size for r in runs], dtype=np.int64)
    end = start + (cache.num_blocks - 1) * stride + size
    meet = (memory[:, None] == memory) & (start[:, None] < end) & (start < end[:, None])
    first, second = np.nonzero(np.triu(meet, k=1))
    step = stride[first]
    gap = (start[second] - start[first]) % np.maximum(step, 1)  # where the second run sits in the first's stride
    apart = (cache.num_blocks > 1) & (step == stride[second]) & (size[first] <= gap) & (gap + size[second] <= step)
    if not apart.all():
        a, b = first[~apart][0], second[~apart][0]
        raise InvalidArgument(f"runs {runs[a]} and {runs[b]} overlap: blocks would share memory")


def _check_clock(engine_clock_ns: int) -> None:
    """Deadlines are the engine's CLOCK_MONOTONIC: refuse an engine whose clock is not ours. Sent
    before we read ours, its clock may lag ours by the request's transit, but never lead it."""
    if not engine_clock_ns:
        raise InvalidArgument("cuda_kv needs RegisterRequest.monotonic_ns (the engine's clock, for deadlines)")
    lead = engine_clock_ns - time.monotonic_ns()
    if lead > MAX_ENGINE_CLOCK_AHEAD_NS or lead < -MAX_ENGINE_CLOCK_BEHIND_NS:
        raise FailedPrecondition(
            f"the engine's CLOCK_MONOTONIC is {lead / 1e9:+.1f} s from this daemon's (another time namespace?); "
            "cuda_ipc deadlines need one clock"
        )


def _device_by_uuid(torch, device_uuid: str) -> int:
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == device_uuid:
            return index
    raise FailedPrecondition(f"GPU {device_uuid} is not visible to this daemon")


@functools.cache
def _cuda_driver() -> ctypes.CDLL:
    driver = ctypes.CDLL("libcuda.so.1")
    driver.cuMemGetAddressRange_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
    return driver


def _allocation_range(pointer: int) -> tuple[int, int]:
    """(base, size) of the GPU allocation `pointer` lies in (in the current context)."""
    base, size = ctypes.c_uint64(), ctypes.c_size_t()
    status = _cuda_driver().cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), pointer)
    if status != 0:
        raise InvalidArgument(f"an opened allocation's address is not mapped (cuMemGetAddressRange: CUresult {status})")
    return base.value, size.value


def _open_cache(torch, device_index: int, cache: pb.CudaKVCache) -> tuple[list, list]:
    """The engine's allocations and ready events, opened through CUDA IPC; each allocation checked to
    lie within the memory its handle opens (a copy past it would fault and poison our context)."""
    with torch.cuda.device(device_index):
        try:
            storages = [_open_storage(torch, device_index, a) for a in cache.allocations]
            ready = [torch.cuda.Event.from_ipc_handle(device_index, handle) for handle in cache.ready_events]
        except RuntimeError as exc:
            raise FailedPrecondition(
                "cannot open the engine's CUDA IPC handles (CUDA opens them only between processes of one user, "
                f"in one PID namespace or one inside the other, and torch's counts are files in its /dev/shm): {exc}"
            ) from None
        for index, (storage, allocation) in enumerate(zip(storages, cache.allocations, strict=True)):
            base, size = _allocation_range(storage.data_ptr())
            claim = f"allocation {index} claims {storage.nbytes()} bytes at offset {allocation.offset}"
            if base != storage.data_ptr() - allocation.offset:  # the offset led into other memory
                raise InvalidArgument(f"{claim}, outside the memory its handle opens")
            if allocation.offset + storage.nbytes() > size:
                raise InvalidArgument(f"{claim}; the memory its handle opens has {size}")
    return storages, ready


def _open_storage(torch, device_index: int, allocation: pb.CudaAllocation):
    """The engine's storage, its IPC event not opened (event_sync_required False): torch would make
    our stream wait for the engine's, blocking the event loop on a hung engine, and never close the
    event. Our copies order themselves by the engine's ready events."""
    return torch.UntypedStorage._new_shared_cuda(
        device_index,
        allocation.ipc_handle,
        allocation.size_bytes,
        allocation.offset,
        allocation.ref_counter_handle,
        allocation.ref_counter_offset,
        allocation.event_handle,
        False,
    )
