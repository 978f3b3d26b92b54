"""A cuda_ipc registration's verdict board: where the GPU tells the engine that a load is over.

A load answered at its launch (CudaIpcTarget.answer_at_launch) is not over when its answer arrives.
The daemon's kernel checks the blocks' checksums in place, on the GPU, and then writes the word
`seq << 2 | OK` (or `| BAD`) into the load's slot of the board: a page of shared memory the daemon
registered with CUDA, which the engine maps read-only. The engine reads that word instead of
waiting for a second message, so no answer is written, sent and read after the last byte.
"""

from __future__ import annotations

import mmap
import os
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import numpy as np

from kvtier.data_socket import DataSocketError

SLOTS = 512  # words of a board (one 4 KiB page): loads answered at launch in flight per registration
OK, BAD = 1, 2  # a word's low two bits: the blocks are in place and match their checksums, or one does not
BOARD_BYTES = SLOTS * 8
SPIN_EARLY_NS = 500_000  # the engine reads the word on every turn from this long before the copy can end
SPIN_NS = 2_000_000  # until this long after it, then every IDLE_S
IDLE_S = 50e-6


def word(seq: int, status: int) -> int:
    return seq << 2 | status


class VerdictBoard:
    """The engine's read-only mapping of a board."""

    def __init__(self, path: Path) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            self._mmap = mmap.mmap(fd, BOARD_BYTES, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        self.words = np.frombuffer(self._mmap, dtype="<u8")

    def wait(self, slot: int, seq: int, copy_end_ns: int, give_up_ns: int, alive: Callable[[], bool]) -> None:
        """Return once slot `slot` says load `seq`'s blocks are in place and verified. Raises
        DataSocketError: DATA_LOSS when a block failed its checksum (the daemon is done with the
        copy); DEADLINE_EXCEEDED past `give_up_ns`, UNAVAILABLE when `alive()` turns False (the
        session is gone): for both, nothing says whether the copy is over."""
        if not 0 <= slot < SLOTS:
            raise DataSocketError(grpc.StatusCode.INTERNAL, f"verdict slot {slot} is outside the board")
        asleep_s = (copy_end_ns - SPIN_EARLY_NS - time.monotonic_ns()) / 1e9
        if asleep_s > 0:
            time.sleep(asleep_s)
        spin_until = copy_end_ns + SPIN_NS
        while True:
            current = int(self.words[slot])
            if current >> 2 == seq:
                break
            if current >> 2 > seq:  # the daemon reuses a slot only once its copy is over
                raise DataSocketError(grpc.StatusCode.ABORTED, f"load {seq}'s verdict was overwritten before it was read")
            now = time.monotonic_ns()
            if now > give_up_ns:
                raise DataSocketError(grpc.StatusCode.DEADLINE_EXCEEDED, f"no verdict for load {seq}", answered=False)
            if now < spin_until:
                os.sched_yield()  # (lets the GIL go to the engine's other threads; time.sleep(0) takes the timer slack)
            elif alive():
                time.sleep(IDLE_S)
            else:
                gone = f"the session ended before load {seq}'s verdict"
                raise DataSocketError(grpc.StatusCode.UNAVAILABLE, gone, answered=False)
        if current & 3 != OK:
            raise DataSocketError(grpc.StatusCode.DATA_LOSS, "a block failed its checksum after the copy; recompute them")

    def close(self) -> None:
        del self.words
        self._mmap.close()
