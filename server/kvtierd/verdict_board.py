"""The daemon's side of a cuda_ipc registration's verdict board (kvtier.verdicts): a page of shared
memory, registered with CUDA so the copy kernel writes each load's outcome into it, that only the
daemon writes and the engine maps read-only (its file's mode: the pool's, without write for others
than the daemon's user)."""

from __future__ import annotations

import itertools
import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvtier import verdicts
from kvtier.cuda_host import CudaHostRegistration


@dataclass
class VerdictBoard:
    path: Path
    _mmap: mmap.mmap
    _base: int  # the board's address (for the GPU too: it is registered with CUDA)
    _cuda: CudaHostRegistration
    _seqs: itertools.count = field(default_factory=lambda: itertools.count(1))
    _slots: itertools.cycle = field(default_factory=lambda: itertools.cycle(range(verdicts.SLOTS)))
    _taken: set[int] = field(default_factory=set)

    @classmethod
    def create(cls, path: Path, mode: int) -> VerdictBoard | None:
        """A new board at `path`; None when CUDA would not register it (loads are then answered when done)."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
        try:
            os.fchmod(fd, mode)
            os.ftruncate(fd, verdicts.BOARD_BYTES)
            board = mmap.mmap(fd, verdicts.BOARD_BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        base = np.frombuffer(board, dtype=np.uint8).ctypes.data  # (the view goes at once: close() can unmap)
        cuda = CudaHostRegistration(base, verdicts.BOARD_BYTES)
        if not cuda.active:
            board.close()
            path.unlink(missing_ok=True)
            return None
        return cls(path, board, base, cuda)

    def take(self) -> tuple[int, int] | None:
        """(slot, seq) for a new load; None when every slot holds a load in flight."""
        if len(self._taken) == verdicts.SLOTS:
            return None
        slot = next(s for s in self._slots if s not in self._taken)
        self._taken.add(slot)
        return slot, next(self._seqs)

    def give_back(self, slot: int) -> None:
        """The slot's load is over (its word written, or never to be)."""
        self._taken.discard(slot)

    def status(self, slot: int, seq: int) -> int:
        """What the GPU wrote for load `seq` in `slot` (verdicts.OK or BAD), once its copy is done; 0
        before (or if it never will)."""
        word = int.from_bytes(self._mmap[8 * slot : 8 * slot + 8], "little")
        return word & 3 if word >> 2 == seq else 0

    def verdict(self, slot: int, seq: int, expected: np.ndarray):
        """What the GPU is to write into `slot` for load `seq` of blocks whose stored checksums are
        `expected`: a gpu_copy.Verdict (at the slot's host address: the board is mapped for the GPU)."""
        from kvtier.gpu_copy import Verdict  # noqa: PLC0415 (needs triton, as every board's daemon has)

        return Verdict(self._base + 8 * slot, verdicts.word(seq, verdicts.OK), verdicts.word(seq, verdicts.BAD), expected)

    def close(self) -> None:
        self._cuda.close()
        self._mmap.close()
        self.path.unlink(missing_ok=True)
