"""Group commit of written block files: the fsyncs and renames that make them durable and visible.

I/O threads write each block to a temporary file and hand it here. One commit job at a time takes every
file waiting (fs_format.commit_files: fsync each, rename each into place, fsync their directories), and
the files written meanwhile wait for the next job. An fsync per file would wait for a journal commit per
file; here one commit serves the whole group, while the I/O threads go on writing. Only when the job
covering a file is done does the tier index the block, so the index (and anything written from it)
never claims a block that a crash could lose.

Runs on the event loop; the jobs run on the tier's I/O threads (through `run`), queued behind the
writes started before them, so a burst of writes is committed in few large groups. Within a job the
fsyncs run through `each` (the tier passes its sync threads' `map`, so they are issued in parallel).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Generic, TypeVar

from kvtierd.fs_format import Each, commit_files

Job = TypeVar("Job")


@dataclass(frozen=True)
class _Written(Generic[Job]):
    temporary: Path
    path: Path
    job: Job


class GroupCommit(Generic[Job]):
    def __init__(
        self,
        run: Callable[..., asyncio.Future],
        committed: Callable[[list[Job], BaseException | None], None],
        each: Each = map,
    ) -> None:
        self._run = run
        self._each = each
        self._committed = committed  # called with the jobs of each commit and its error
        self._waiting: list[_Written[Job]] = []
        self._busy = False
        self.commits = 0  # commit jobs run

    def add(self, temporary: Path, path: Path, job: Job) -> None:
        """`job`'s block is complete in `temporary`: commit it to `path` with the next commit job."""
        self._waiting.append(_Written(temporary, path, job))
        if not self._busy:
            self._start()

    def _start(self) -> None:
        group, self._waiting = self._waiting, []
        self._busy = True
        self.commits += 1
        files = [(w.temporary, w.path) for w in group]
        self._run(commit_files, files, self._each).add_done_callback(partial(self._done, group))

    def _done(self, group: list[_Written[Job]], future: asyncio.Future) -> None:
        self._busy = False
        exc = future.exception() if not future.cancelled() else asyncio.CancelledError()
        self._committed([w.job for w in group], exc)
        if self._waiting:
            self._start()
