"""How the daemon's event loop watches a GPU copy (gpu_transfers._landed), on the CPU: asleep until
shortly before the copy can have ended, then a check on every turn of the loop, and sparse checks
once it runs long; the loop serves other work meanwhile. The copy here ends at a set time on the
clock, as a CUDA event completes on the GPU's."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import uvloop

from kvtierd import gpu_transfers
from kvtierd.gpu_transfers import POLL_EARLY_S, _landed


@dataclass
class CopyEndingAt:
    """What _landed asks of gpu_copy.LaunchedCopy (`finished`), for a copy that ends at `end`."""

    end: float
    checks: list[float] = field(default_factory=list)

    def finished(self) -> bool:
        now = asyncio.get_running_loop().time()
        self.checks.append(now)
        return now >= self.end


def test_asleep_until_just_before_the_expected_end_then_checked_every_turn():
    async def main():
        loop = asyncio.get_running_loop()
        start = loop.time()
        copy = CopyEndingAt(start + 0.020)
        turns = 0

        async def other_work():
            nonlocal turns
            while loop.time() < copy.end:
                turns += 1
                await asyncio.sleep(0)

        await asyncio.gather(_landed(copy, expected_end=copy.end), other_work())
        return start, copy, loop.time(), turns

    start, copy, returned, turns = uvloop.run(main())
    assert copy.checks[0] >= copy.end - POLL_EARLY_S - 0.002  # asleep for most of the copy (timers: whole ms)
    assert len(copy.checks) > 10  # then checked on every turn of the loop
    assert copy.checks[-1] >= copy.end and returned - copy.end < 0.005  # seen done at once
    assert turns > 10  # other work ran meanwhile


def test_a_copy_running_long_is_checked_sparsely(monkeypatch):
    monkeypatch.setattr(gpu_transfers, "FAST_POLL_S", 0.005)

    async def main():
        loop = asyncio.get_running_loop()
        expected = loop.time() + 0.002
        copy = CopyEndingAt(expected + 0.100)  # far slower than expected (a slower link, or contention)
        await _landed(copy, expected_end=expected)
        return expected, copy

    expected, copy = uvloop.run(main())
    late = [t for t in copy.checks if t > expected + 0.005 + 0.002]
    assert copy.checks[-1] >= copy.end
    assert 20 <= len(late) <= 120  # about one check per millisecond, not one per turn of the loop


def test_expected_end_queues_copies_in_one_direction():
    async def main():
        transfers = gpu_transfers.GpuTransfers(pool_address=0, page_size=4096, pool_registered=False)
        now = asyncio.get_running_loop().time()
        gb = int(gpu_transfers.LINK_BYTES_PER_S / 1000)  # one millisecond of link
        first, second = transfers._expected_end(0, False, gb), transfers._expected_end(0, False, gb)
        other_way, other_gpu = transfers._expected_end(0, True, gb), transfers._expected_end(1, False, gb)
        return now, first, second, other_way, other_gpu

    now, first, second, other_way, other_gpu = uvloop.run(main())
    assert abs(first - now - 0.001) < 0.0005 and abs(second - first - 0.001) < 1e-9
    assert abs(other_way - first) < 0.0005 and abs(other_gpu - first) < 0.0005
