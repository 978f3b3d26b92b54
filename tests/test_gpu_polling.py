"""How the daemon's event loop watches a GPU copy (gpu_transfers._landed), on the CPU: asleep until
shortly before the copy can have ended, then a check on every turn of the loop, and sparse checks
once it runs long; the loop serves other work meanwhile. The copy here ends at a set time on the
clock, as a CUDA event completes on the GPU's. The loop runs on a virtual clock (virtual_clock.py),
so that what is asserted is the policy, not how a loaded machine happened to schedule the test."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np
import pytest
from virtual_clock import TURN_S, run_on_virtual_clock

from kvtier.copy_plan import LaunchFailed
from kvtierd import gpu_transfers
from kvtierd.gpu_transfers import FAST_POLL_S, POLL_EARLY_S, SLOW_POLL_S, _landed


@dataclass
class CopyEndingAt:
    """What _landed asks of gpu_copy.LaunchedCopy (`finished`), for a copy that ends at `end`."""

    end: float
    checks: list[float] = field(default_factory=list)

    def finished(self) -> bool:
        now = asyncio.get_running_loop().time()
        self.checks.append(now)
        return now >= self.end


async def turns_until(end: float) -> int:
    """Other work on the event loop: how many turns it took until the loop's clock reached `end`."""
    loop, turns = asyncio.get_running_loop(), 0
    while loop.time() < end:
        turns += 1
        await asyncio.sleep(0)
    return turns


@pytest.mark.parametrize("woken_late_s", [0.0, 0.025], ids=["woken-on-time", "woken-25ms-late"])
def test_asleep_until_just_before_the_expected_end_then_checked_every_turn(woken_late_s):
    # a loop woken late (a loaded machine) still checks on every turn for FAST_POLL_S after it wakes
    async def main():
        loop = asyncio.get_running_loop()
        expected = loop.time() + 0.0203
        copy = CopyEndingAt(expected + woken_late_s + FAST_POLL_S / 2)

        async def landed_at() -> float:
            await _landed(copy, expected_end=expected)
            return loop.time()

        returned, turns = await asyncio.gather(landed_at(), turns_until(copy.end))
        return expected, copy, returned, turns

    expected, copy, returned, turns = run_on_virtual_clock(main(), timer_late_s=woken_late_s)
    assert expected - POLL_EARLY_S <= copy.checks[0] <= expected + woken_late_s  # asleep until shortly before
    assert len(copy.checks) > 10 and max(np.diff(copy.checks)) < 2 * TURN_S  # then checked on every turn
    assert copy.end <= copy.checks[-1] and returned - copy.end < 2 * TURN_S  # seen done at once
    assert turns > 10  # other work ran meanwhile


def test_a_copy_running_long_is_checked_sparsely():
    async def main():
        loop = asyncio.get_running_loop()
        expected = loop.time() + 0.002
        copy = CopyEndingAt(expected + 0.100)  # far slower than expected (a slower link, or contention)
        await _landed(copy, expected_end=expected)
        return expected, copy

    expected, copy = run_on_virtual_clock(main())
    late = np.array([t for t in copy.checks if t > expected + FAST_POLL_S + TURN_S])
    assert copy.end <= late[-1] <= copy.end + 2 * SLOW_POLL_S  # seen done soon after it ended
    gaps = np.diff(late)  # one check per SLOW_POLL_S (timers: whole milliseconds), not one per turn
    assert len(late) > 10 and gaps.min() > SLOW_POLL_S - TURN_S and gaps.max() < SLOW_POLL_S + 0.001 + TURN_S


def test_a_cancelled_caller_still_waits_for_its_copy_then_is_cancelled():
    # the caller's deadline passes during the copy: the copy still owns its pages, so the caller
    # goes on (and its pages can be freed) only once the copy is done, and then sees the cancellation
    async def main():
        loop = asyncio.get_running_loop()
        copy = CopyEndingAt(loop.time() + 0.030)
        waiter = asyncio.ensure_future(_landed(copy, expected_end=loop.time() + 0.002))
        await asyncio.sleep(0.005)
        waiter.cancel()
        await asyncio.sleep(0.005)
        waiter.cancel()  # a second cancellation is held back too
        try:
            await waiter
        except asyncio.CancelledError:
            return copy, loop.time()
        raise AssertionError("the cancellation was lost")

    copy, ended = run_on_virtual_clock(main())
    assert copy.checks[-1] >= copy.end and ended >= copy.end


@dataclass(frozen=True)
class Lane:
    """What LinkClock asks of gpu_copy.CopyLane: a key, and its device."""

    device: str
    name: str


def test_link_clock_queues_a_lane_and_shares_the_link_between_lanes():
    clock, ms = gpu_transfers.LinkClock(), int(gpu_transfers.LINK_BYTES_PER_S / 1000)  # bytes per ms
    a, b, c, other_gpu = Lane("cuda:0", "a"), Lane("cuda:0", "b"), Lane("cuda:0", "c"), Lane("cuda:1", "a")

    def started(now: float, lane: Lane, to_pool: bool, size: int) -> float:
        end = clock.expected_end(now, lane, to_pool, size)
        clock.book(lane, to_pool, end)
        return end

    assert started(0.0, a, False, 100 * ms) == 0.100  # alone: its bytes at the link's rate
    assert clock.expected_end(0.0, a, False, ms) == 0.101  # behind the lane's own copy (only asked)
    assert started(0.0, a, False, ms) == 0.101  # (and started)
    assert abs(started(0.0, b, False, ms) - 0.002) < 1e-12  # shares the link: not queued behind a
    assert started(0.0, c, True, 10 * ms) == 0.010  # the other direction: a link of its own
    assert started(0.0, other_gpu, False, 10 * ms) == 0.010  # another GPU: its own link
    assert abs(started(0.5, b, False, 10 * ms) - 0.510) < 1e-12  # the others have ended


def test_a_faster_link_is_expected_to_end_its_copies_sooner():
    """A GPU whose link was measured faster (NVLink-C2C, PCIe Gen6) gets its copies expected at its
    own rate: the daemon neither sleeps past their end nor refuses copies that would meet their
    deadline. Another GPU keeps the default."""
    fast, default = Lane("cuda:0", "a"), Lane("cuda:1", "a")
    clock = gpu_transfers.LinkClock(rates={"cuda:0": 8 * gpu_transfers.LINK_BYTES_PER_S})
    size = int(gpu_transfers.LINK_BYTES_PER_S / 10)  # 0.1 s at the default rate
    assert abs(clock.expected_end(0.0, fast, False, size) - 0.0125) < 1e-12
    assert abs(clock.expected_end(0.0, default, False, size) - 0.1) < 1e-12


def transfers_with(launch) -> tuple[gpu_transfers.GpuTransfers, gpu_transfers.CudaRegistration]:
    """A daemon's GpuTransfers on a CPU, with one registration, whose copies `launch` enqueues."""
    transfers = gpu_transfers.GpuTransfers(pool_address=0, page_size=4096, pool_registered=True)
    registration = gpu_transfers.CudaRegistration("reg", "session", "ns", 0, [], SimpleNamespace(block_bytes=4096), 8, [])
    transfers._registrations[registration.id] = registration
    transfers._next_lane[0] = itertools.cycle([Lane("cuda:0", "a")])
    transfers._launch = launch
    return transfers, registration


def test_a_copy_failing_after_part_was_enqueued_waits_for_that_part_while_the_loop_serves():
    """gpu_copy.launch_copy raises LaunchFailed when enqueueing fails midway (a driver call, or host
    memory for the call's arrays): the call's error goes up only once what was enqueued has landed
    (then its pages may be freed), the event loop serving other work meanwhile instead of blocking
    on the lane, and the registration, whose session ended during the wait, closes after it."""

    async def main():
        loop = asyncio.get_running_loop()
        enqueued = CopyEndingAt(loop.time() + 0.030)

        def launch_failing_midway(*args):
            raise LaunchFailed(enqueued) from RuntimeError("cuMemcpyBatchAsync failed")

        transfers, registration = transfers_with(launch_failing_midway)

        async def session_ends():
            await asyncio.sleep(0.005)
            await transfers.close_session("session")

        load = asyncio.ensure_future(transfers.load(registration, np.arange(2), np.zeros((2, 1), dtype=np.int64)))
        closing = asyncio.ensure_future(session_ends())
        turns = await turns_until(enqueued.end)
        with pytest.raises(LaunchFailed) as failed:
            await load
        failed_at = loop.time()
        await closing
        return enqueued, failed.value, failed_at, turns, registration

    enqueued, failed, failed_at, turns, registration = run_on_virtual_clock(main())
    assert isinstance(failed.__cause__, RuntimeError)
    assert enqueued.checks[-1] >= enqueued.end and failed_at >= enqueued.end  # not before it landed
    assert turns > 10  # the loop served other work meanwhile
    assert registration.in_flight == 0 and registration.closed.is_set()


@dataclass
class LandingCopy(CopyEndingAt):
    """A launched copy that also has its checksums once done (gpu_copy.LaunchedCopy)."""

    def checksums(self) -> np.ndarray:
        assert self.finished()
        return np.array([7, 8], dtype=np.uint64)


def test_a_loads_meanwhile_runs_once_its_copy_is_enqueued_and_before_it_has_landed():
    """The data service makes a load's answer while its bytes move (`meanwhile`): after the launch,
    before the copy is seen done; the checksums come once it has landed."""

    async def main():
        loop = asyncio.get_running_loop()
        copy, launches, meanwhile = LandingCopy(loop.time() + 0.030), [], []
        transfers, registration = transfers_with(lambda *args: launches.append(loop.time()) or copy)
        sums = await transfers.load(
            registration, np.arange(2), np.zeros((2, 1), dtype=np.int64), meanwhile=lambda: meanwhile.append(loop.time())
        )
        return copy, launches, meanwhile, sums, loop.time()

    copy, launches, meanwhile, sums, returned = run_on_virtual_clock(main())
    assert len(launches) == 1 and meanwhile == launches  # right after the launch, in the same turn
    assert meanwhile[0] < copy.end <= copy.checks[-1] <= returned
    assert sums.tolist() == [7, 8]


def test_a_loads_meanwhile_failing_goes_up_only_once_the_copy_has_landed():
    """Its copy still owns the pages and the registration: the error goes up once the copy has
    landed, and a registration whose session ended meanwhile closes then."""

    async def main():
        loop = asyncio.get_running_loop()
        copy = LandingCopy(loop.time() + 0.030)
        transfers, registration = transfers_with(lambda *args: copy)

        def failing():
            raise ValueError("a bug in the answer")

        blocks, pages = np.arange(2), np.zeros((2, 1), dtype=np.int64)
        load = asyncio.ensure_future(transfers.load(registration, blocks, pages, meanwhile=failing))
        await asyncio.sleep(0.005)
        closing = asyncio.ensure_future(transfers.close_session("session"))
        await asyncio.sleep(0.005)
        closed_early = registration.closed.is_set()
        with pytest.raises(ValueError, match="a bug"):
            await load
        failed_at = loop.time()
        await closing
        return copy, failed_at, closed_early, registration

    copy, failed_at, closed_early, registration = run_on_virtual_clock(main())
    assert failed_at >= copy.end and copy.checks[-1] >= copy.end  # not before the copy landed
    assert not closed_early and registration.in_flight == 0 and registration.closed.is_set()


class ReadyEvent:
    """An engine's ready event, as the daemon queries it."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


def test_a_store_whose_forward_ends_as_the_daemon_shuts_down_launches_nothing():
    """A store waits for its engine's forward when the daemon shuts its GPU side down, and the forward
    ends in that same turn: its copy must not start (it would read through mappings and write pool
    pages the shutdown lets go); the registration closes once the call has ended."""
    launched: list[list] = []

    async def main() -> BaseException | None:
        transfers, registration = transfers_with(lambda reg, *_: launched.append(list(reg.storages)))
        registration.storages.append(object())  # (an opened allocation)
        ready = ReadyEvent()
        store = asyncio.ensure_future(transfers.store(registration, np.arange(1), np.zeros((1, 1), np.int64), ready))
        await asyncio.sleep(0.01)  # the store polls the ready event
        transfers.close()
        ready.done = True
        try:
            await store
        except gpu_transfers.FailedPrecondition as refused:
            assert registration.closed.is_set() and registration.storages == []
            return refused
        return None

    assert asyncio.run(main()) is not None and launched == []
