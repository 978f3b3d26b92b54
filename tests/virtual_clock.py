"""An asyncio event loop on a virtual clock, for tests of timing policy (how long a task sleeps, how
often it polls) that must not depend on how a loaded machine schedules the test process. The clock
moves by TURN_S on every turn of the loop and, when nothing is ready, straight to the next timer.
Timers fire on a whole millisecond, as uvloop's (the daemon's loop) do, and `timer_late_s` later
still, as on a machine that wakes the loop late."""

from __future__ import annotations

import asyncio
import math
import selectors
from collections.abc import Coroutine

TURN_S = 10e-6  # what one turn of the loop costs on the virtual clock


class _AdvancingSelector(selectors.DefaultSelector):
    """Never waits: a poll that would wait moves the clock on by as long instead."""

    def __init__(self, loop: VirtualClockLoop):
        super().__init__()
        self._loop = loop

    def select(self, timeout=None):
        if timeout is None:
            raise RuntimeError("nothing is ready or scheduled: the loop would wait forever")
        events = super().select(0)
        self._loop.now += max(timeout, TURN_S)
        return events


class VirtualClockLoop(asyncio.SelectorEventLoop):
    def __init__(self, timer_late_s: float = 0.0):
        self.now = 0.0
        self.timer_late_s = timer_late_s
        super().__init__(_AdvancingSelector(self))

    def time(self) -> float:
        return self.now

    def call_at(self, when, callback, *args, context=None):
        when = math.ceil(round(when * 1000, 6)) / 1000 + self.timer_late_s
        return super().call_at(when, callback, *args, context=context)


def run_on_virtual_clock(main: Coroutine, timer_late_s: float = 0.0):
    with asyncio.Runner(loop_factory=lambda: VirtualClockLoop(timer_late_s)) as runner:
        return runner.run(main)
