"""The filesystem tier's engine: demotion, write-through, promotion and deletion, with every file
operation on a thread pool (--fs-io-threads), so the event loop never waits on the disk.

Demotion and write-through copy; they do not hold pages. BlockStore calls `on_evict` with its victims
while their pages still hold their bytes, and hands those pages to a new reservation as soon as it
returns; `committed` gets blocks just committed (written through with --fs-write-through). Both copy
each block's bytes into an aligned staging buffer on a copy thread of their own (a numpy gather,
which lets the GIL go: 0.1 to 1 ms per 2 MiB block on this VM, which the event loop used to spend
itself) and start its write once it is copied, so the disk is busy while the next blocks are
copied. Pages handed to a reservation may still be being read by those copies: whoever writes
into a reservation's pages first waits for the copies that read them (`copies_landed`: the data
service before it answers a Reserve or copies a GPU store, promotion before its reads); nothing
reads the pool pages after that. Staging buffers are made and
first-touched on an I/O thread when a block size is first committed, and reused (fs_staging); their
bytes waiting for the disk are bounded by --fs-queue-size; blocks beyond it are not written (counted
as skipped; a write-through block skipped is still demoted when it is evicted). (Write-through used to copy on the I/O threads
from held pool pages: 0.58 of dd-style writes against 0.70 for this, in alternating runs here.)

Promotion reserves pool pages (a reservation that never expires, since a thread writes into its pages
until the read returns), reads each file straight into those pages, all reads of one call in parallel
on threads of their own (--fs-io-threads more), so that a load never waits behind queued writes,
verifies them and commits the reservation. A block that fails (bad checksum, truncated, missing) is
dropped from both tiers, so the prefix ends before it.

A block is written to a temporary file on an I/O thread, fsync'd there and renamed into place
(fs_format.write_block_file; the temporary file is the file of a block the tier evicted to make
room, when there is one that no read has open: on a virtual disk, rewriting a file whose space is
allocated is far faster than a new one), and enters the index after that, so the index never
claims a block whose bytes a crash could lose. Its directory is fsync'd later, before the next
index file names it (save_index): until then a power cut may undo the rename, which loses only the
block. So is the directory of every file removed (evicted, deleted, corrupt), so that a file the
index file no longer lists cannot come back. (Grouping the fsyncs into commit jobs, with a
directory fsync each, ran slower on this VM's journal-less ext4: with no journal there is no commit
to share, and each extra fsync writes an inode synchronously.)

A failing disk (full, read-only, I/O errors) pauses stores for PAUSE_SECONDS with one logged error per
pause and a metric; reads and the RAM tier go on.
"""

from __future__ import annotations

import asyncio
import logging
import re
import sys
import time
from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
from tqdm import tqdm

from kvtier.v1 import kvtier_pb2 as pb
from kvtierd.block_store import Block, BlockStore, Namespace, Reservation
from kvtierd.errors import KVTierError, NotFound
from kvtierd.fs_format import (
    FANOUT,
    TMP_SUFFIX,
    BadBlock,
    Header,
    align_up,
    aligned_empty,
    block_path,
    charged_bytes,
    fanout_of,
    fsync_directory,
    probe_direct_io,
    read_block,
    remove_file,
    remove_namespace_dir,
    scan_namespace,
    write_block_file,
    write_spec,
)
from kvtierd.fs_index import FsCounters, FsEntry, FsIndex
from kvtierd.fs_snapshot import INDEX_FILE, directory_mtimes, read_index_file, write_index_file
from kvtierd.fs_staging import StagingBuffers, touched_buffers
from kvtierd.shm_pool import SharedPool

log = logging.getLogger("kvtierd.fs")

FS_TIER = "fs"
PAUSE_SECONDS = 30.0
_PROMOTER = "kvtierd-fs-promotion"  # owner of promotion reservations (no session has this id)
_DIGEST = re.compile(r"[0-9a-f]{32}")

Key = tuple[str, bytes]


class TierClosed(RuntimeError):
    """A file job started after the tier closed (the daemon is stopping): it fails at once."""


@dataclass(frozen=True)
class FsSettings:
    root: Path
    capacity: int
    eviction: str
    write_through: bool
    io_threads: int
    direct_io: bool
    queue_bytes: int
    index_interval: float  # seconds between index file writes


@dataclass
class FsHealth:
    read_errors: int = 0
    write_errors: int = 0
    paused_until: float = 0.0  # monotonic time before which stores are refused
    skipped: Counter = field(default_factory=Counter)  # blocks not written, by reason

    @property
    def paused(self) -> bool:
        return time.monotonic() < self.paused_until


@dataclass(eq=False)
class _Copy:
    """A block to copy out of the pool and write: its pages, where its bytes go, its write (a job for
    an I/O thread), the removal job it must follow (if any), the files evicted for it, and the
    future of its write."""

    pages: np.ndarray  # [1, pages per block]
    out: np.ndarray  # [1, block bytes] of its staging buffer
    write: partial
    removal: asyncio.Future | None
    evicted: list[Path]
    evicted_bytes: int  # what the evicted files count against --fs-size
    written: asyncio.Future


@dataclass(eq=False)
class _Write:
    namespace: Namespace
    hash: bytes
    created_at: float
    evicted: list[FsEntry]  # the blocks it evicted to make room (their files removed or written over)
    deletions: int  # FsTier._deletions when it evicted them
    cancelled: bool = False  # deleted while being written: the file is removed when it is complete
    written: asyncio.Future | None = None  # done once the file is written (or its write failed)
    intact: list[Path] = field(default_factory=list)  # the files of `evicted` still there after it failed


@dataclass
class Deletion:
    """What a DeleteBlocks or Clear took off disk: the hashes that were indexed, per namespace; the jobs
    removing its blocks' files; and the writes in flight it cancelled (for `FsTier.gone`)."""

    hashes: dict[str, set[bytes]] = field(default_factory=lambda: defaultdict(set))
    removals: list[asyncio.Future] = field(default_factory=list)
    cancelled: list[Key] = field(default_factory=list)


class FsTier:
    def __init__(self, settings: FsSettings, pool: SharedPool, store: BlockStore) -> None:
        self.settings = settings
        self.root = settings.root
        self.pool = pool
        self.store = store
        self.index = FsIndex(settings.capacity, settings.eviction)
        self.health = FsHealth()
        self.direct = False
        self.staging = StagingBuffers(settings.queue_bytes)
        self.executor = ThreadPoolExecutor(settings.io_threads, thread_name_prefix="kvtierd-fs")
        self.readers = ThreadPoolExecutor(settings.io_threads, thread_name_prefix="kvtierd-fs-read")  # not behind writes
        self.copier = ThreadPoolExecutor(1, thread_name_prefix="kvtierd-fs-copy")  # out of the pool, not behind writes
        self.indexer = ThreadPoolExecutor(1, thread_name_prefix="kvtierd-fs-index")  # index files, not behind writes
        self.remover = ThreadPoolExecutor(1, thread_name_prefix="kvtierd-fs-remove")  # deletions, not behind writes
        self._copies: set[asyncio.Future] = set()  # copies out of the pool still reading their pages
        self._copied_pages = np.zeros(len(pool.view.pages), dtype=np.int32)  # per pool page: copies reading it
        self._writes: dict[Key, _Write] = {}
        self._promotions: dict[Key, asyncio.Future] = {}
        self._deleted_while_promoted: set[Key] = set()  # not to be committed when their reads return
        self._deletions = 0  # DeleteBlocks and Clear calls so far (a failed write's victims come back only if none came)
        self._jobs: set[asyncio.Future] = set()
        self._spec_written: set[str] = set()
        self._unsynced: set[Path] = set()  # fan-out directories with renames or removals not yet fsync'd
        self._reading: Counter[Path] = Counter()  # files an I/O thread is reading: not to be reused
        self._removals: dict[Path, asyncio.Future] = {}  # the job still to remove (or rename away) each file
        self._unlisted: set[Path] = set()  # fan-out directories with a file the disk refused to remove (_unlink)
        self._saved_changes = -1  # index.changes when the index file was last written
        self._staging_sizes: set[int] = set()  # sizes of the staging buffers made ahead of need

    # ------------------------------------------------------------------ start and stop

    def open(self) -> list[pb.NamespaceSpec]:
        """Index the blocks already under the root (file names only; each file's header and checksum
        are checked when it is first read). Returns the specs of the namespaces found holding blocks
        (an empty one, cleared or evicted, would only take one of --max-namespaces: its directory is
        removed, and made again when its engines store into it)."""
        started = time.perf_counter()
        self.root.mkdir(parents=True, exist_ok=True)
        if self.settings.direct_io:
            self.direct = probe_direct_io(self.root)
            if not self.direct:
                log.warning("the filesystem refuses O_DIRECT; the fs tier uses buffered I/O", extra={"path": str(self.root)})
        try:
            entries = list(self.root.iterdir())
            directories = sorted(d for d in entries if d.is_dir() and _DIGEST.fullmatch(d.name))
        except OSError as exc:  # a failing disk: the tier starts empty, and its first write pauses stores
            log.error("cannot list the fs tier; no block on it is served", extra={"path": str(self.root), "reason": str(exc)})
            entries, directories = [], []
        known = read_index_file(self.root)
        specs, strays, listed, emptied = [], 0, 0, 0
        for stray in entries:  # an interrupted index file write
            if stray.name.startswith(f"{INDEX_FILE}.") and stray.name.endswith(TMP_SUFFIX):
                strays += remove_file(stray)
        with tqdm(
            total=len(directories) * len(FANOUT), desc="indexing fs tier", unit="dir", disable=not sys.stderr.isatty()
        ) as bar:
            for directory in directories:
                try:
                    scanned = scan_namespace(directory, known.get(directory.name, {}), bar)
                except OSError as exc:
                    fields = {"path": str(directory), "reason": str(exc)}
                    log.error("cannot list an fs tier namespace; its blocks are not served", extra=fields)
                    continue
                if scanned is None:
                    log.warning("ignoring a directory without a valid namespace.pb", extra={"path": str(directory)})
                    continue
                strays += scanned.strays
                listed += scanned.listed
                if not scanned.hashes:  # (cleared or evicted): its next write makes what is missing again
                    emptied += remove_namespace_dir(directory)
                    continue
                self.index.add_many(directory.name, scanned.hashes, scanned.spec.block_bytes)
                self._spec_written.add(directory.name)
                specs.append(scanned.spec)
        excess = [self._path(e) for e in self.index.over_capacity()]
        list(self.executor.map(self._unlink, excess))
        self._unsynced.update(path.parent for path in excess)
        log.info(
            "fs tier indexed",
            extra={
                "path": str(self.root),
                "blocks": len(self.index),
                "bytes": self.index.used_bytes,
                "capacity": self.settings.capacity,
                "evicted_over_capacity": len(excess),
                "stray_files_removed": strays,
                "empty_namespaces_removed": emptied,
                "directories_listed": listed,
                "directories_from_index_file": len(directories) * len(FANOUT) - listed,
                "direct_io": self.direct,
                "seconds": round(time.perf_counter() - started, 3),
            },
        )
        return specs

    async def close(self, timeout: float) -> None:
        """Wait (up to `timeout`) for file jobs in flight (and the jobs they start), write the index
        file, then stop the thread pool."""
        deadline = time.monotonic() + timeout
        while self._jobs and time.monotonic() < deadline:
            await asyncio.wait(set(self._jobs), timeout=deadline - time.monotonic())
        if self._jobs:
            log.warning("fs jobs still running at shutdown", extra={"jobs": len(self._jobs)})
        await self.save_index()
        self.executor.shutdown(wait=False, cancel_futures=True)
        self.copier.shutdown(wait=False, cancel_futures=True)
        self.indexer.shutdown(wait=False, cancel_futures=True)
        self.readers.shutdown(wait=False, cancel_futures=True)
        self.remover.shutdown(wait=False, cancel_futures=True)

    async def keep_index_file(self) -> None:
        """Rewrite the index file every --fs-index-interval while the index changes (a task of the daemon)."""
        while True:
            await asyncio.sleep(self.settings.index_interval)
            await self.save_index()

    async def save_index(self) -> None:
        """Write the index file (fs_snapshot) unless nothing changed since the last one. The directories'
        mtimes are taken first, then those with writes or removals in flight are left out, then the hashes copied,
        then the directories renamed into or removed from since the last index file are fsync'd, so
        the names on disk are those the file records. All on a thread of its own: behind a queue of
        writes, a heavy burst would keep the index file from being written until it ends."""
        changes = self.index.changes
        if changes == self._saved_changes:
            return
        started = time.perf_counter()
        try:
            mtimes = await self._run(directory_mtimes, self.root, list(self.index.blocks), FANOUT, executor=self.indexer)
            for ns_id, block_hash in self._writes:
                mtimes.get(ns_id, {}).pop(fanout_of(block_hash), None)
            for directory in {path.parent for path in self._removals} | self._unlisted:  # (else: a file unlisted)
                mtimes.get(directory.parent.name, {}).pop(directory.name, None)
            hashes = {digest: list(self.index.blocks[digest]) for digest in mtimes}
            unsynced, self._unsynced = self._unsynced, set()
            try:
                await self._run(_fsync_directories, unsynced, executor=self.indexer)
            except OSError:
                self._unsynced |= unsynced
                raise
            await self._run(write_index_file, self.root, mtimes, hashes, fanout_of, executor=self.indexer)
        except (OSError, TierClosed) as exc:
            log.warning("cannot write the fs index file", extra={"reason": str(exc)})
            return
        self._saved_changes = changes
        log.debug("fs index file written", extra={"blocks": len(self.index), "seconds": round(time.perf_counter() - started, 3)})

    # ------------------------------------------------------------------ lookup and promotion

    def lookup(self, ns: Namespace, hashes: list[bytes]) -> tuple[int, list[bytes]]:
        """How many leading hashes are in the pool or on disk, and which of those only on disk (counted
        as the tier's hits; the hashes after the prefix as its misses)."""
        on_disk = self.index.blocks[ns.id]
        in_pool = ns.blocks
        count = next((i for i, h in enumerate(hashes) if h not in in_pool and h not in on_disk), len(hashes))
        from_disk = [h for h in hashes[:count] if h not in in_pool]
        self.index.hit(ns.id, from_disk, len(hashes) - count)
        return count, from_disk

    async def promote(self, ns: Namespace, hashes: list[bytes]) -> None:
        """Bring blocks that are on disk into the pool as committed blocks; a block that cannot be read
        intact is left out (so a prefix ends before it). The reads and their commit belong to the tier:
        a caller cancelled meanwhile (its deadline) stops waiting, and the promotion still ends, so
        its reservation and its files are let go."""
        waits = [self._promotions[(ns.id, h)] for h in hashes if (ns.id, h) in self._promotions]
        wanted = [h for h in hashes if h not in ns.blocks and (ns.id, h) not in self._promotions]
        if wanted:
            promotion = self._start_promotion(ns, wanted)
            if promotion is not None:
                waits.append(promotion)
        if waits:
            await asyncio.shield(asyncio.gather(*waits))

    def _start_promotion(self, ns: Namespace, wanted: list[bytes]) -> asyncio.Future | None:
        """Reserve pool pages for `wanted` and start their reads (a task of the tier's, in `_jobs`)."""
        paths = [self._path_of(ns.id, h) for h in wanted]
        self._reading.update(paths)  # the reservation's evictions must not write over the files to read
        try:
            reservation = self.store.reserve(_PROMOTER, ns, wanted, admit_all=True).reservation
        except BaseException:
            self._unread(paths)
            raise
        if reservation is None:
            self._unread(paths)
            return None
        reservation.expires_at = float("inf")  # threads write into its pages until their reads return
        loop = asyncio.get_running_loop()
        for block in reservation.blocks:
            self._promotions[(ns.id, block.hash)] = loop.create_future()
        task = asyncio.ensure_future(self._read_and_commit(ns, reservation, paths))
        self._jobs.add(task)
        task.add_done_callback(self._jobs.discard)
        return task

    async def _read_and_commit(self, ns: Namespace, reservation: Reservation, paths: list[Path]) -> None:
        try:
            await self.copies_landed(reservation.page_ids)  # (they may have been a victim's, still being copied out)
            outcomes = await asyncio.gather(
                *(self._read(self._path_of(ns.id, b.hash), self._read_into_pool, ns, b) for b in reservation.blocks),
                return_exceptions=True,
            )
            self._promoted(ns, reservation, outcomes)
        finally:
            self._unread(paths)  # (each read holds its own file until it returns)

    def _read_into_pool(self, ns: Namespace, block: Block) -> Header:
        segments = self.pool.view.block_buffers(np.frombuffer(block.pages, dtype="<u4"))
        return read_block(self._path_of(ns.id, block.hash), ns.id, block.hash, ns.block_bytes, segments, self.direct)

    def _promoted(self, ns: Namespace, reservation: Reservation, outcomes: list) -> None:
        checksums = np.zeros(len(reservation.blocks), dtype=np.uint64)
        failed: list[Block] = []
        for i, (block, outcome) in enumerate(zip(reservation.blocks, outcomes, strict=True)):
            if (ns.id, block.hash) in self._deleted_while_promoted:
                self._deleted_while_promoted.discard((ns.id, block.hash))
                failed.append(block)
            elif isinstance(outcome, Header):
                checksums[i] = outcome.checksum
                entry = self.index.get(ns.id, block.hash)
                if entry is not None:
                    entry.created_at = outcome.created_at
            else:
                failed.append(block)
                self._read_failed(ns, block.hash, outcome)
        try:
            for block in failed:  # (a block cleared meanwhile is not ours to touch: its hash may be an engine's new block)
                self.store.withdraw(block)
            self.index.counters[ns.id].loaded_blocks += self.store.commit(_PROMOTER, reservation.id, checksums)
        except KVTierError as exc:  # the namespace was cleared meanwhile
            log.info("promotion dropped", extra={"namespace": ns.id, "reason": str(exc)})
        finally:
            for block in reservation.blocks:
                self._promotions.pop((ns.id, block.hash)).set_result(None)

    def _read_failed(self, ns: Namespace, block_hash: bytes, exc: BaseException) -> None:
        """A file that cannot serve its block leaves the index; a corrupt one is also deleted."""
        if isinstance(exc, TierClosed):  # (the file is as good as before)
            return
        entry = self.index.get(ns.id, block_hash)
        if entry is not None:
            self.index.remove(entry)
        fields = {"namespace": ns.id, "hash": block_hash.hex(), "reason": str(exc)}
        charge = entry.charge if entry is not None else 0
        if isinstance(exc, FileNotFoundError):
            log.info("fs block file missing; dropped", extra=fields)
        elif isinstance(exc, BadBlock):
            self.index.counters[ns.id].checksum_failures += 1
            log.warning("fs block file corrupt; deleted", extra=fields)
            self._remove([self._path_of(ns.id, block_hash)], charge)
        elif isinstance(exc, OSError):
            self.health.read_errors += 1
            log.warning("fs block read failed; dropped", extra=fields)
            self._remove([self._path_of(ns.id, block_hash)], charge)  # (left, it would sit unlisted, uncounted)
        else:
            log.error("fs block read failed", extra=fields, exc_info=exc)

    # ------------------------------------------------------------------ demotion and write-through

    def on_evict(self, victims: list[Block]) -> None:
        """BlockStore's eviction hook: copy the victims' bytes out of the pool and write them to disk."""
        groups: dict[Namespace, list[Block]] = defaultdict(list)
        on_disk = []
        for block in victims:
            entry = self.index.get(block.namespace.id, block.hash)
            if entry is not None:
                on_disk.append(entry)
            elif (block.namespace.id, block.hash) not in self._writes:
                groups[block.namespace].append(block)
        self.index.demoted(on_disk)  # (before the writes below evict files to make room)
        for ns, blocks in groups.items():
            self._stage_and_write(ns, blocks)

    def committed(self, ns: Namespace, blocks: list[Block]) -> None:
        """Blocks just committed to the pool: written through with --fs-write-through. The first
        commit of a block size also has its staging buffers made ahead of the first demotions."""
        self._make_staging(align_up(ns.block_bytes))
        if self.settings.write_through:
            self._stage_and_write(ns, [b for b in blocks if ns.blocks.get(b.hash) is b and self._wanted(ns, b.hash)])

    def _make_staging(self, stride: int) -> None:
        """Make (and first-touch) the staging buffers of `stride` bytes that fit --fs-queue-size on an
        I/O thread, once per size: first touches on the event loop, when a burst of evictions needs
        the buffers, would hold it up (about 0.7 s per GiB on a VM)."""
        if stride in self._staging_sizes:
            return
        self._staging_sizes.add(stride)
        count = self.staging.spare(stride)
        if count:
            self._run(touched_buffers, stride, count).add_done_callback(self._staging_made)

    def _staging_made(self, future: asyncio.Future) -> None:
        exc = future.exception() if not future.cancelled() else asyncio.CancelledError()
        if exc is not None:
            log.warning("fs tier: staging buffers not made ahead; they are made when needed", extra={"reason": str(exc)})
            return
        self.staging.keep(future.result())

    def _stage_and_write(self, ns: Namespace, blocks: list[Block]) -> None:
        """Copy the blocks' bytes out of the pool into staging buffers and write each once it is copied."""
        if self.health.paused:
            self.health.skipped["paused"] += len(blocks)
            return
        stride = align_up(ns.block_bytes)
        room = self.staging.room(stride)
        if room < len(blocks):
            self.health.skipped["queue_full"] += len(blocks) - room
            blocks = blocks[:room]
        checksums = self.store.checksum[[b.slot for b in blocks]].tolist()
        copies: list[_Copy] = []
        try:
            for i, (block, checksum) in enumerate(zip(blocks, checksums, strict=True)):
                victims = self.index.reserve(ns.block_bytes)
                if victims is None:
                    self.health.skipped["tier_full"] += 1
                    continue
                try:
                    copies.append(self._staged_write(ns, block, checksum, stride, victims))
                except MemoryError:  # the blocks go unwritten; the pool evicts them all the same
                    self.health.skipped["no_memory"] += len(blocks) - i
                    log.warning("fs tier: no memory for staging buffers; blocks not written", extra={"blocks": len(blocks) - i})
                    break
        finally:  # (the writes staged so far go ahead whatever stopped the loop)
            if copies:
                self._copy_and_write(ns.block_bytes, copies)

    def _staged_write(self, ns: Namespace, block: Block, checksum: int, stride: int, victims: list[FsEntry]) -> _Copy:
        """A block's write from a staging buffer, over (or after removing) the files of the `victims`
        evicted for it (index.reserve charged it), to start once its copy is made (`_copy_and_write`).
        Should this fail, the charge and the buffer go back and the evicted files are removed, before
        the error goes up (a copy or write that fails later goes the way of a failed write, `_written`)."""
        buffer = None
        evicted = [self._path(victim) for victim in victims]
        evicted_bytes = sum(victim.charge for victim in victims)
        try:
            buffer = self.staging.take(stride)
            job = _Write(ns, block.hash, time.time(), victims, self._deletions)
            reuse = next((path for path in evicted if not self._reading[path]), None)
            copy = _Copy(
                pages=np.frombuffer(block.pages, dtype="<u4").reshape(1, -1),
                out=buffer[: ns.block_bytes].reshape(1, -1),
                write=partial(self._write_file, job, checksum, buffer, reuse, [p for p in evicted if p != reuse]),
                removal=self._removals.get(self._path_of(ns.id, block.hash)),  # of this block's file, from before
                evicted=evicted,
                evicted_bytes=evicted_bytes,
                written=asyncio.get_running_loop().create_future(),
            )
        except BaseException:
            self.index.unreserve(ns.block_bytes)
            if buffer is not None:
                self.staging.give_back(buffer)
            if evicted:
                self._remove(evicted, evicted_bytes)
            raise
        self._jobs.add(copy.written)
        copy.written.add_done_callback(self._jobs.discard)
        self._writes[(ns.id, block.hash)] = job
        job.written = copy.written
        self._removing_by(evicted, copy.written)
        copy.written.add_done_callback(partial(self._written, job, buffer))
        return copy

    def _copy_and_write(self, block_bytes: int, copies: list[_Copy]) -> None:
        """Copy the blocks out of their pool pages on the copy thread, which hands each block's write to
        an I/O thread as soon as it is copied, so writes start while the event loop still works
        through a large eviction (a write that must wait for a `removal` job is started from the loop
        instead). The pages may be handed to a reservation meanwhile, whose writers wait for the
        copies (`copies_landed`). A block whose copy fails is not written, and the files evicted for
        it are removed."""

        def copy_then_write() -> list:  # on the copy thread: per block, its write's future or its failure
            outcomes = []
            for copy in copies:
                try:
                    self.pool.view.read_blocks(copy.pages, block_bytes, copy.out)
                except Exception as exc:  # noqa: BLE001 (this block goes unwritten; the others go on)
                    outcomes.append(exc)
                    continue
                try:
                    outcomes.append(self.executor.submit(copy.write) if copy.removal is None else None)
                except RuntimeError:  # the I/O threads are shut down
                    outcomes.append(TierClosed("the fs tier is closed"))
            return outcomes

        pages = np.concatenate([copy.pages.ravel() for copy in copies])
        job = self._run(copy_then_write, executor=self.copier)
        self._copies.add(job)
        self._copied_pages[pages] += 1  # (the blocks' pages are distinct)

        def copied(_: asyncio.Future) -> None:
            self._copies.discard(job)
            self._copied_pages[pages] -= 1
            if job.cancelled() or job.exception() is not None:  # (its thread is shut down: the tier closed)
                for copy in copies:
                    self._remove(copy.evicted, copy.evicted_bytes)
                    _pass_on(copy.written, job)
                return
            for copy, outcome in zip(copies, job.result(), strict=True):
                if isinstance(outcome, BaseException):
                    self._remove(copy.evicted, copy.evicted_bytes)
                    copy.written.set_exception(outcome)
                elif outcome is None:
                    self._run_after(copy.removal, copy.write).add_done_callback(partial(_pass_on, copy.written))
                else:
                    asyncio.wrap_future(outcome).add_done_callback(partial(_pass_on, copy.written))

        job.add_done_callback(copied)

    async def copies_landed(self, page_ids: bytes) -> None:
        """Wait until no copy out of the pool (a demotion, a write-through) still reads any of these
        pages (a reservation's `page_ids`): they are the reservation's alone from then on."""
        pages = np.frombuffer(page_ids, dtype="<u4")
        while self._copied_pages[pages].any():
            await asyncio.wait(set(self._copies), return_when=asyncio.FIRST_COMPLETED)

    def _wanted(self, ns: Namespace, block_hash: bytes) -> bool:
        return self.index.get(ns.id, block_hash) is None and (ns.id, block_hash) not in self._writes

    def _write_file(self, job: _Write, checksum: int, buffer: np.ndarray, reuse: Path | None, evicted: list[Path]) -> None:
        """Write the block over the evicted file `reuse` (if any), after removing the other `evicted`
        (first, so the files on disk never exceed --fs-size). A failed write leaves no file of either,
        unless the disk refuses to remove them (read-only): those are `intact`, and indexed again."""
        self._unlink_all(evicted)
        ns = job.namespace
        try:
            if ns.id not in self._spec_written:
                write_spec(self.root, ns.spec)
                self._spec_written.add(ns.id)
            path = self._path_of(ns.id, job.hash)
            write_block_file(
                path, ns.id, job.hash, ns.block_bytes, checksum, job.created_at, [memoryview(buffer)], self.direct, reuse=reuse
            )
        except BaseException:
            if reuse is not None:
                self._unlink(reuse)  # (gone already if it became the temporary file, which the failed write removed)
            job.intact = [path for path in [*evicted, reuse] if path is not None and path.exists()]
            raise

    def _written(self, job: _Write, buffer: np.ndarray, future: asyncio.Future) -> None:
        """The block's file is durable under its name (or its write failed), and the files evicted for
        it are gone (one of them may have become it): its staging buffer goes back, and the block is
        indexed unless it was deleted meanwhile."""
        self.staging.give_back(buffer)
        ns = job.namespace
        del self._writes[(ns.id, job.hash)]
        exc = future.exception() if not future.cancelled() else asyncio.CancelledError()
        if exc is not None or job.cancelled:
            self.index.unreserve(ns.block_bytes)
            if exc is not None:
                self._write_failed(exc)
                if job.deletions == self._deletions:  # (else one of them may have been deleted meanwhile)
                    self._index_again([entry for entry in job.evicted if self._path(entry) in job.intact])
            else:
                self._remove([self._path_of(ns.id, job.hash)], charged_bytes(ns.block_bytes))
            return
        self.index.add(ns.id, job.hash, ns.block_bytes, job.created_at, reserved=True)
        self.index.counters[ns.id].stored_blocks += 1
        self._unsynced.add(self._path_of(ns.id, job.hash).parent)

    def _index_again(self, entries: list[FsEntry]) -> None:
        """Blocks evicted for a write that failed whose files the disk kept (read-only, or failing):
        they serve again, as far as they fit (writes started since may have taken their room). Not
        after a DeleteBlocks or Clear meanwhile: evicted, they were out of its reach."""
        for entry in reversed(entries):  # (evicted coldest first: each goes back as the next victim)
            if not self.index.restore(entry):
                self._remove([self._path(entry)], entry.charge)

    def _write_failed(self, exc: BaseException) -> None:
        if isinstance(exc, TierClosed):
            log.info("fs tier closed; a block was not written")
            return
        self.health.write_errors += 1
        if not isinstance(exc, OSError):
            log.error("fs block write failed", exc_info=exc)
            return
        reason = f"{exc.strerror or exc} ({exc.filename})"
        if not self.health.paused:
            log.error(
                "fs tier: writing to disk failed; stores paused, the RAM tier keeps serving",
                extra={"errno": exc.errno, "reason": reason, "retry_in_seconds": PAUSE_SECONDS},
            )
        self.health.paused_until = time.monotonic() + PAUSE_SECONDS

    # ------------------------------------------------------------------ admin

    def delete(self, ns_id: str, hashes: list[bytes]) -> Deletion:
        """Delete blocks from disk (writes in flight are cancelled); `gone` waits for their files."""
        self._deletions += 1
        entries = [e for e in map(partial(self.index.get, ns_id), hashes) if e is not None]
        cancelled = []
        for block_hash in hashes:
            job = self._writes.get((ns_id, block_hash))
            if job is not None:
                job.cancelled = True
                cancelled.append((ns_id, block_hash))
            if (ns_id, block_hash) in self._promotions:
                self._deleted_while_promoted.add((ns_id, block_hash))
        pending = [path for path in map(partial(self._path_of, ns_id), hashes) if path in self._removals]
        return self._delete_entries(entries, cancelled, pending)

    def clear(self, ns_id: str | None) -> Deletion:
        """Delete every block of a namespace (or all); `gone` waits for their files."""
        self._deletions += 1
        cancelled = []
        for key, job in self._writes.items():
            if ns_id is None or key[0] == ns_id:
                job.cancelled = True
                cancelled.append(key)
        pending = [path for path in self._removals if ns_id is None or path.parent.parent.name == ns_id]
        return self._delete_entries(self.index.entries(ns_id), cancelled, pending)

    def _delete_entries(self, entries: list[FsEntry], cancelled: list[Key], pending: list[Path]) -> Deletion:
        """Take the blocks out of the index and remove their files on the remover thread (not behind
        queued writes). Files of the deleted blocks out of the index already whose removal waits for
        another job (`pending`: evicted for a write still queued) are removed now too; that job then
        finds them gone (a write that was to reuse one makes a new file)."""
        deleted = Deletion(cancelled=cancelled)
        if pending:  # (an indexed file has no removal pending: these are none of `entries`)
            removal = self._run(self._unlink_all, pending, executor=self.remover)
            for path in pending:  # (a new file of that name still waits for the other job too)
                self._removing_by([path], _when_both(self._removals[path], removal))
            deleted.removals.append(removal)
        for entry in entries:
            self.index.remove(entry)
            deleted.hashes[entry.namespace].add(entry.hash)
        if entries:
            paths = [self._path(e) for e in entries]
            deleted.removals.append(self._remove(paths, sum(e.charge for e in entries), executor=self.remover))
        return deleted

    async def gone(self, deletion: Deletion) -> None:
        """Wait until the files of a deletion are removed: their removal, and the writes in flight it
        cancelled, each with the removal of its file once written. A crash after that cannot bring the
        blocks back (a crash before it can: the next start finds the files still there)."""
        if deletion.removals:
            await asyncio.wait(deletion.removals)
        while True:  # (a cancelled write's file is removed once written, by a job that starts then)
            pending = {self._removals.get(self._path_of(*key)) for key in deletion.cancelled}
            pending |= {job.written for key in deletion.cancelled if (job := self._writes.get(key)) is not None and job.cancelled}
            pending.discard(None)
            if not pending:
                return
            await asyncio.wait(pending)

    async def inspect(self, ns: Namespace, block_hash: bytes) -> tuple[FsEntry, np.ndarray, Header]:
        """Read one block from disk (verified like any read: a bad file is dropped and NOT_FOUND)."""
        entry = self.index.get(ns.id, block_hash)
        if entry is None:
            raise NotFound(f"block {block_hash.hex()} is not on disk in namespace {ns.id}")
        buffer = aligned_empty(align_up(ns.block_bytes))
        path = self._path_of(ns.id, block_hash)
        try:
            header = await self._read(
                path, read_block, path, ns.id, block_hash, ns.block_bytes, [memoryview(buffer)], self.direct
            )
        except (OSError, BadBlock) as exc:
            self._read_failed(ns, block_hash, exc)
            raise NotFound(f"block {block_hash.hex()} could not be read intact from disk and was dropped: {exc}") from exc
        if self.index.get(ns.id, block_hash) is entry:  # (a block indexed at start learns its time on first read)
            entry.created_at = header.created_at
        return entry, buffer[: ns.block_bytes], header

    def totals(self, ns_id: str | None) -> tuple[FsCounters, int, int]:
        """(counters, blocks, data bytes) of one namespace or of the whole tier (also from a metrics
        scrape's thread: what the event loop may change meanwhile is copied first)."""
        counters = FsCounters()
        blocks = used = 0
        for digest in [ns_id] if ns_id is not None else list(self.index.blocks):
            counters.add(self.index.counters[digest])
            entries = self.index.blocks[digest]
            blocks += len(entries)
            used += len(entries) * self.index.block_bytes.get(digest, 0)  # (the store's or not: retired)
        return counters, blocks, used

    # ------------------------------------------------------------------ plumbing

    def _path_of(self, ns_id: str, block_hash: bytes) -> Path:
        return block_path(self.root, ns_id, block_hash)

    def _path(self, entry: FsEntry) -> Path:
        return self._path_of(entry.namespace, entry.hash)

    def _remove(self, paths: list[Path], charge: int, executor: ThreadPoolExecutor | None = None) -> asyncio.Future:
        """Unlink files on an I/O thread (the job). They are out of the index, but until they are gone
        they still count against --fs-size (`charge`), so writes meanwhile do not take their room twice."""
        self.index.removing_bytes += charge
        job = self._run(self._unlink_all, paths, executor=executor)
        self._removing_by(paths, job)

        def removed(_: asyncio.Future) -> None:
            self.index.removing_bytes -= charge

        job.add_done_callback(removed)
        return job

    def _unlink_all(self, paths: list[Path]) -> None:
        for path in paths:
            self._unlink(path)

    def _unlink(self, path: Path) -> None:
        """On an I/O thread: remove a file out of the index. Should the disk refuse (failing), the file
        stays, unlisted and uncounted: its directory is then left out of every index file, so the next
        start lists it and finds the file."""
        if not remove_file(path):
            self._unlisted.add(path.parent)

    def _removing_by(self, paths: list[Path], job: asyncio.Future) -> None:
        """`job` removes (or renames away) these files. Until it ends, a write of the same name waits
        for it (or the removal, should its thread start late, would take the new file) and index files
        leave their directories out; then those are fsync'd before the next index file."""
        for path in paths:
            self._removals[path] = job

        def done(_: asyncio.Future) -> None:
            for path in paths:
                if self._removals.get(path) is job:
                    del self._removals[path]
            self._unsynced.update(path.parent for path in paths)

        job.add_done_callback(done)

    def _read(self, path: Path, function, *args) -> asyncio.Future:
        """`_run` a read of the file `path`, which is not reused for another block meanwhile."""
        self._reading[path] += 1
        future = self._run(function, *args, executor=self.readers)
        future.add_done_callback(lambda _: self._unread([path]))
        return future

    def _unread(self, paths: list[Path]) -> None:
        self._reading.subtract(paths)
        for path in paths:
            if not self._reading[path]:
                del self._reading[path]

    def _run_after(self, before: asyncio.Future | None, function, *args) -> asyncio.Future:
        """`_run`, once the job `before` (if any) has ended."""
        if before is None:
            return self._run(function, *args)
        later = asyncio.get_running_loop().create_future()
        self._jobs.add(later)
        later.add_done_callback(self._jobs.discard)
        before.add_done_callback(lambda _: self._run(function, *args).add_done_callback(partial(_pass_on, later)))
        return later

    def _run(self, function, *args, executor: ThreadPoolExecutor | None = None) -> asyncio.Future:
        """The job on an I/O thread; after the tier closed, a future failed with TierClosed."""
        loop = asyncio.get_running_loop()
        try:
            future = loop.run_in_executor(executor or self.executor, function, *args)
        except RuntimeError:  # its threads are shut down
            future = loop.create_future()
            future.set_exception(TierClosed("the fs tier is closed"))
        self._jobs.add(future)
        future.add_done_callback(self._jobs.discard)
        return future


def _fsync_directories(directories: set[Path]) -> None:
    for directory in directories:
        try:
            fsync_directory(directory)
        except FileNotFoundError:  # removed by hand meanwhile: nothing of it left to make durable
            pass


def _when_both(first: asyncio.Future, second: asyncio.Future) -> asyncio.Future:
    """A future done (with None) once both are, whatever their outcomes."""
    both = asyncio.get_running_loop().create_future()

    def check(_: asyncio.Future) -> None:
        if first.done() and second.done() and not both.done():
            both.set_result(None)

    first.add_done_callback(check)
    second.add_done_callback(check)
    return both


def _pass_on(target: asyncio.Future, source: asyncio.Future) -> None:
    if source.cancelled():
        target.cancel()
    elif source.exception() is not None:
        target.set_exception(source.exception())
    else:
        target.set_result(source.result())
