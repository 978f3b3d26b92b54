"""Group commit of the directory fsyncs that make block files' renames durable.

A block file is complete and fsync'd before it is renamed into place, so after a crash its name either
points at the whole block or is gone; what the directory fsync adds is that the name survives a crash.
One fsync of a directory covers every rename made in it before, so instead of one per file the tier
hands each renamed file here: one job at a time fsyncs every directory with renames waiting, and the
files that arrive meanwhile wait for the next job. Only when the job covering a file is done does the
tier index the block, so the index (and the index file written from it) never claims a block that a
crash could lose.

Runs on the event loop; the fsyncs run on the tier's thread pool (through `run`).
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Generic, TypeVar

from kvtierd.fs_format import fsync_directories

Job = TypeVar("Job")


class GroupCommit(Generic[Job]):
    def __init__(
        self,
        run: Callable[..., asyncio.Future],
        committed: Callable[[list[Job], BaseException | None], None],
    ) -> None:
        self._run = run
        self._committed = committed  # called with the jobs of each directory fsync job and its error
        self._waiting: dict[Path, list[Job]] = defaultdict(list)
        self._busy = False
        self.syncs = 0  # directory fsync jobs run

    def add(self, directory: Path, job: Job) -> None:
        """`job`'s file was renamed into `directory`: commit it with the next directory fsync job."""
        self._waiting[directory].append(job)
        if not self._busy:
            self._start()

    def _start(self) -> None:
        batch, self._waiting = self._waiting, defaultdict(list)
        self._busy = True
        self.syncs += 1
        self._run(fsync_directories, list(batch)).add_done_callback(partial(self._done, batch))

    def _done(self, batch: dict[Path, list[Job]], future: asyncio.Future) -> None:
        self._busy = False
        exc = future.exception() if not future.cancelled() else asyncio.CancelledError()
        self._committed([job for jobs in batch.values() for job in jobs], exc)
        if self._waiting:
            self._start()
