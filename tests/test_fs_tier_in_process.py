"""The filesystem tier in process, with the real pool, block store, tier and files, for what a test
must order (the tier's I/O threads held at a gate) or watch (the directories the tier fsyncs)."""

from __future__ import annotations

import asyncio
import errno
import os
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import uvloop
from blocks import block_content, chain_hashes, contents, spec

from kvtier import checksum
from kvtier.pool_view import decode_page_ids
from kvtier.v1 import kvtier_pb2 as pb
from kvtierd import fs_staging, fs_tier
from kvtierd.block_store import BlockStore, Namespace
from kvtierd.data_service import DataService
from kvtierd.errors import NotFound, Unauthenticated
from kvtierd.fs_format import aligned_empty, block_path, charged_bytes, read_block
from kvtierd.fs_snapshot import RACY_SECONDS
from kvtierd.fs_tier import FsSettings, FsTier
from kvtierd.sessions import Session, SessionRegistry
from kvtierd.shm_pool import SharedPool

BLOCK = 64 << 10  # one pool page; the pool holds four blocks, the tier two


@dataclass
class Tiers:
    pool: SharedPool
    store: BlockStore
    fs: FsTier
    ns: Namespace

    async def put(self, block_hash: bytes, on_disk: int) -> None:
        """Store a block in the pool, and wait until `on_disk` blocks are on disk (its victim's demotion)."""
        data = contents([block_hash], BLOCK)
        reservation = self.store.reserve("s", self.ns, [block_hash]).reservation
        await self.fs.copies_landed(reservation.page_ids)  # (as the daemon's Reserve does: the victim's copy has read them)
        self.pool.view.write_blocks(decode_page_ids(reservation.page_ids, self.ns.pages_per_block), data)
        self.store.commit("s", reservation.id, checksum.block_checksums(data))
        self.fs.committed(self.ns, reservation.blocks)  # (as the daemon's Commit does)
        while len(self.fs.index) < on_disk:
            await asyncio.sleep(0.005)

    async def demote_first(self, hashes: list[bytes]) -> None:
        """Fill the pool with the first four blocks, then store the fifth: the first goes to disk."""
        for block_hash in hashes[:4]:
            await self.put(block_hash, 0)
        await self.put(hashes[4], 1)

    def data_service(self, limits: pb.Limits) -> tuple[DataService, Session]:
        """The daemon's data service over these tiers, and an engine's session in it."""
        sessions = SessionRegistry()
        service = DataService(self.store, self.pool, sessions, None, limits, pb.PoolInfo(), self.fs, None)
        return service, sessions.open(pb.Hello(engine_name="engine"), "peer")

    async def held_promotion(self, block_hash: bytes) -> tuple[threading.Event, asyncio.Future]:
        """Start a promotion of the block on disk with every I/O thread held (the returned gate lets
        them go), once it has reserved its pool pages."""
        gate = hold_io_threads(self.fs)
        promotion = asyncio.ensure_future(self.fs.promote(self.ns, [block_hash]))
        while block_hash not in self.ns.pending:
            await asyncio.sleep(0.001)
        return gate, promotion

    async def settle(self) -> None:
        while self.fs._jobs:
            await asyncio.wait(set(self.fs._jobs))

    def path(self, block_hash: bytes) -> Path:
        return block_path(self.fs.root, self.ns.id, block_hash)


def daemon_limits(**changes: int) -> pb.Limits:
    """The limits a daemon with the default options announces, with `changes`."""
    return pb.Limits(**{"max_message_bytes": 64 << 20, "max_batch_blocks": 4096, **changes})


def run_with_tiers(tmp_path: Path, body: Callable[[Tiers], Awaitable[None]]) -> None:
    shm_dir = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="kvt-in-process-"))  # (tmp_path's name repeats between runs)
    pool = SharedPool(shm_dir, "kvt-in-process-", 4 * BLOCK, BLOCK, 0o600)

    async def main() -> None:
        store = BlockStore(num_pages=4, page_size=BLOCK)
        settings = FsSettings(
            root=tmp_path / "fs",
            capacity=2 * charged_bytes(BLOCK),
            eviction="lru",
            write_through=False,
            io_threads=2,
            direct_io=False,
            queue_bytes=8 * BLOCK,
            index_interval=3600.0,
        )
        fs = FsTier(settings, pool, store)
        fs.open()
        store.on_evict = fs.on_evict
        tiers = Tiers(pool, store, fs, store.register(spec(block_bytes=BLOCK)))
        try:
            await body(tiers)
        finally:
            await fs.close(timeout=5)

    try:
        uvloop.run(main())
    finally:
        pool.close()
        shm_dir.rmdir()


def hold_io_threads(fs: FsTier, readers: bool = True) -> threading.Event:
    """Keep every I/O thread of the tier (those that write, and unless told not to, those that read)
    busy until the returned gate is set."""
    gate = threading.Event()
    for executor in (fs.executor, fs.readers) if readers else (fs.executor,):
        for _ in range(fs.settings.io_threads):
            executor.submit(gate.wait)
    return gate


def test_a_file_being_read_is_not_written_over_for_another_block(tmp_path):
    """A promotion's read of block A is still to run when the demotion that its own reservation
    causes needs room on the full disk and evicts A: the demotion must write a new file instead of
    rewriting A's (a reader that had A open would read another block's bytes, and drop A as corrupt)."""
    a, b, c, d, e, f = chain_hashes("reading", 6)

    async def body(t: Tiers) -> None:
        await t.demote_first([a, b, c, d, e])  # A goes to disk, then B: the tier is full, A its least recently used
        await t.put(f, 2)
        link = tmp_path / "a.link"
        link.hardlink_to(t.path(a))
        gate, promotion = await t.held_promotion(a)  # its reservation evicts C; C's demotion evicts A
        assert t.fs.index.get(t.ns.id, a) is None and t.fs.index.inflight_bytes > 0  # A evicted, C's write waiting
        gate.set()
        await promotion
        await t.settle()
        assert np.array_equal(np.fromfile(link, dtype=np.uint8)[-BLOCK:], block_content(a, BLOCK))  # A's file kept its bytes
        assert t.fs.index.counters[t.ns.id].checksum_failures == 0
        data = aligned_empty(BLOCK)
        read_block(t.path(c), t.ns.id, c, BLOCK, [memoryview(data)], direct=False)
        assert np.array_equal(data, block_content(c, BLOCK))  # C written in full, to a file of its own

    run_with_tiers(tmp_path, body)


def test_a_directory_that_only_loses_a_file_is_fsynced_before_the_next_index_file(tmp_path, monkeypatch):
    """Otherwise a power cut could bring back a file that the index file no longer lists."""
    synced: list[Path] = []

    def fsync_directory(path: Path) -> None:
        synced.append(path)
        real_fsync_directory(path)

    real_fsync_directory = fs_tier.fsync_directory
    monkeypatch.setattr(fs_tier, "fsync_directory", fsync_directory)
    a, b, c, d, e = chain_hashes("durable", 5)

    async def body(t: Tiers) -> None:
        await t.demote_first([a, b, c, d, e])  # A goes to disk
        await t.fs.save_index()
        assert t.path(a).parent in synced  # the rename into it
        synced.clear()
        t.fs.delete(t.ns.id, [a])
        await t.settle()
        assert not t.path(a).exists()
        await t.fs.save_index()
        assert synced == [t.path(a).parent]

    run_with_tiers(tmp_path, body)


def test_file_jobs_started_after_the_tier_closed_fail_instead_of_hanging(tmp_path):
    """While the daemon stops, a call still running may reach the tier after it closed (its threads
    shut down): a promotion then ends as a miss, and a write queued behind a removal fails, instead
    of leaving their callers (and every later lookup of those blocks) waiting for good."""
    a, b, c, d, e = chain_hashes("closed", 5)

    async def body(t: Tiers) -> None:
        await t.demote_first([a, b, c, d, e])  # A goes to disk
        await t.fs.close(timeout=5)
        await asyncio.wait_for(t.fs.promote(t.ns, [a]), timeout=5)
        assert a not in t.ns.blocks and not t.fs._promotions and not t.ns.pending
        removal = asyncio.get_running_loop().create_future()
        later = t.fs._run_after(removal, os.getpid)
        removal.set_result(None)
        with pytest.raises(fs_tier.TierClosed):
            await asyncio.wait_for(later, timeout=5)

    run_with_tiers(tmp_path, body)


def test_a_promotion_whose_caller_is_cancelled_still_ends_and_lets_go_of_its_pages(tmp_path):
    """A caller's deadline cancels it while its blocks are read from disk (a slow disk): the reads
    still end, and the block is committed to the pool; nothing stays reserved or awaited for good
    (a later Reserve of it would answer IN_PROGRESS forever, a later lookup wait on it forever)."""
    a, b, c, d, e = chain_hashes("cancelled", 5)

    async def body(t: Tiers) -> None:
        await t.demote_first([a, b, c, d, e])  # A goes to disk
        gate, caller = await t.held_promotion(a)  # reserved, its read waiting for a thread
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        gate.set()
        await t.settle()
        assert not t.fs._promotions and not t.fs._reading and not t.ns.pending
        block = t.ns.blocks[a]
        in_pool = t.pool.view.read_blocks(np.frombuffer(block.pages, dtype="<u4").reshape(1, -1), BLOCK)
        assert np.array_equal(in_pool[0], block_content(a, BLOCK))
        await t.fs.promote(t.ns, [a])  # nothing left to wait for

    run_with_tiers(tmp_path, body)


def test_a_block_deleted_while_it_is_promoted_is_not_brought_back(tmp_path):
    """DeleteBlocks (the pool's blocks, then the tier's) during a promotion's read: the block must not
    be committed to the pool when the read returns."""
    a, b, c, d, e = chain_hashes("deleted", 5)

    async def body(t: Tiers) -> None:
        await t.demote_first([a, b, c, d, e])  # A goes to disk
        gate, promotion = await t.held_promotion(a)
        t.store.delete(t.ns, [a])
        assert t.fs.delete(t.ns.id, [a]).hashes == {t.ns.id: {a}}
        gate.set()
        await promotion
        await t.settle()
        assert a not in t.ns.blocks and a not in t.ns.pending and t.fs.index.get(t.ns.id, a) is None
        assert not t.path(a).exists()

    run_with_tiers(tmp_path, body)


def test_a_block_deleted_while_its_demotion_is_written_does_not_come_back(tmp_path):
    """DeleteBlocks (Clear alike) while the block's file is being written: the write ends, and the file
    goes instead of being indexed."""
    a, b, c, d, e = chain_hashes("deleted-written", 5)

    async def body(t: Tiers) -> None:
        for block_hash in (a, b, c, d):
            await t.put(block_hash, 0)
        gate = hold_io_threads(t.fs, readers=False)
        await t.put(e, 0)  # evicts A from the pool: its file's write waits for an I/O thread
        assert (t.ns.id, a) in t.fs._writes
        assert not t.fs.delete(t.ns.id, [a]).hashes  # (not on disk yet)
        gate.set()
        await t.settle()
        assert t.fs.index.get(t.ns.id, a) is None and not t.path(a).exists() and len(t.fs.index) == 0

    run_with_tiers(tmp_path, body)


def test_a_block_cleared_during_its_promotion_and_stored_again_keeps_the_new_copy(tmp_path):
    """Clear during a promotion's read removes the file, so the read fails; meanwhile the engine stored
    the block again. The promotion must drop only its own block, not the engine's new one."""
    a, b, c, d, e = chain_hashes("cleared-stored-again", 5)

    async def body(t: Tiers) -> None:
        await t.demote_first([a, b, c, d, e])  # A goes to disk
        await t.settle()
        gate = threading.Event()
        for _ in range(t.fs.settings.io_threads):
            t.fs.readers.submit(gate.wait)
        promotion = asyncio.ensure_future(t.fs.promote(t.ns, [a]))
        while a not in t.ns.pending:
            await asyncio.sleep(0.001)
        t.store.clear(t.ns)  # as AdminService.Clear does
        t.fs.clear(t.ns.id)
        while t.path(a).exists():
            await asyncio.sleep(0.005)
        await t.put(a, 0)  # the engine stores A again
        gate.set()
        await promotion
        await t.settle()
        assert a in t.ns.blocks and t.fs.index.counters[t.ns.id].loaded_blocks == 0
        _, lease = t.store.lookup("s", t.ns, [a], pin=True)
        pages = decode_page_ids(lease.page_ids, t.ns.pages_per_block)
        assert np.array_equal(t.pool.view.read_blocks(pages, BLOCK)[0], block_content(a, BLOCK))

    run_with_tiers(tmp_path, body)


@pytest.mark.parametrize("call", ["clear", "delete"])
def test_a_deletion_is_gone_only_once_a_write_it_cancelled_has_left_no_file(tmp_path, monkeypatch, call):
    """A block deleted while its write is in flight: the write still puts its file under the block's
    name, which is removed after it. `gone` (what DeleteBlocks and Clear wait for before they answer)
    waits for both, so that a crash after the answer finds no file to index again."""
    a, b, c, d, e = chain_hashes(f"gone-{call}", 5)
    gate = threading.Event()

    def held_write_block_file(*args, **kwargs):
        gate.wait()
        real_write_block_file(*args, **kwargs)

    real_write_block_file = fs_tier.write_block_file
    monkeypatch.setattr(fs_tier, "write_block_file", held_write_block_file)

    async def body(t: Tiers) -> None:
        for block_hash in (a, b, c, d):
            await t.put(block_hash, 0)
        await t.put(e, 0)  # A's demotion: its write waits at the gate
        while (t.ns.id, a) not in t.fs._writes:
            await asyncio.sleep(0.001)
        deletion = t.fs.clear(t.ns.id) if call == "clear" else t.fs.delete(t.ns.id, [a])
        gone = asyncio.ensure_future(t.fs.gone(deletion))
        await asyncio.sleep(0.05)
        assert not gone.done()
        gate.set()
        while not t.path(a).exists() and not gone.done():  # (the write puts its file in place first)
            await asyncio.sleep(0.001)
        await gone
        assert not t.path(a).exists() and t.fs.index.get(t.ns.id, a) is None

    try:
        run_with_tiers(tmp_path, body)
    finally:
        gate.set()


def test_a_block_the_pool_lets_go_of_keeps_its_file_over_older_ones(tmp_path):
    """A block on disk and in the pool (promoted), used from the pool meanwhile, is evicted from the
    pool together with one that goes to disk: its file, now its only copy, must not be what makes
    room for the other (its disk recency was that of its promotion, older than other files')."""
    a, b, c, d, e, f, g, h = chain_hashes("demoted-again", 8)

    async def body(t: Tiers) -> None:
        await t.demote_first([a, b, c, d, e])  # A goes to disk
        await t.put(f, 2)  # then B: the tier is full
        t.fs.lookup(t.ns, [a])
        await t.fs.promote(t.ns, [a])  # its reservation evicts C from the pool, and C's write B's file
        await t.settle()
        assert t.fs.index.get(t.ns.id, b) is None and t.fs.index.get(t.ns.id, c) is not None
        t.store.lookup("s", t.ns, [d, e, f], pin=False)  # A is the pool's least recently used now
        t.store.reserve("s", t.ns, [g, h])  # evicts A (on disk already) and D (to be written)
        await t.settle()
        assert a not in t.ns.blocks and t.fs.index.get(t.ns.id, d) is not None
        assert t.fs.index.get(t.ns.id, a) is not None and t.path(a).exists()  # C's file made room instead
        assert t.fs.index.get(t.ns.id, c) is None

    run_with_tiers(tmp_path, body)


def test_a_demotions_copy_holds_up_neither_the_event_loop_nor_the_bytes_it_copies(tmp_path):
    """A Reserve evicts A: A's bytes are copied out of its pages on the tier's copy thread (held here)
    while the event loop serves other calls. The Reserve answers, handing A's pages to the caller,
    only once the copy has read them: the caller's bytes, written at once, do not reach A's file.
    A Reserve of pages no copy reads (B's, deleted) answers meanwhile."""
    a, b, c, d, e, f = chain_hashes("copy-off-the-loop", 6)

    async def body(t: Tiers) -> None:
        for block_hash in (a, b, c, d):
            await t.put(block_hash, 0)
        await t.settle()  # (staging buffers made ahead)
        service, session = t.data_service(daemon_limits())
        session.namespaces.add(t.ns.id)
        gate = threading.Event()
        t.fs.copier.submit(gate.wait)
        try:
            request = pb.ReserveRequest(session_id=session.id, namespace=t.ns.id, hashes=e)
            reserve = asyncio.ensure_future(DataService.Reserve.__wrapped__(service, request, None))
            lookup = pb.LookupRequest(session_id=session.id, namespace=t.ns.id, hashes=b)
            served = await asyncio.wait_for(DataService.Lookup.__wrapped__(service, lookup, None), timeout=5)
            assert served.hit_count == 1  # the loop serves calls meanwhile
            await asyncio.sleep(0.05)
            assert not reserve.done() and a not in t.ns.blocks  # A evicted; its copy not done
            t.store.delete(t.ns, [b])
            other = pb.ReserveRequest(session_id=session.id, namespace=t.ns.id, hashes=f)
            free_pages = await asyncio.wait_for(DataService.Reserve.__wrapped__(service, other, None), timeout=5)
            assert free_pages.page_ids == t.ns.pending[f].pages and not reserve.done()
        finally:
            gate.set()
        response = await asyncio.wait_for(reserve, timeout=10)
        t.pool.view.write_blocks(decode_page_ids(response.page_ids, t.ns.pages_per_block), contents([e], BLOCK))
        await t.settle()
        data = aligned_empty(BLOCK)
        read_block(t.path(a), t.ns.id, a, BLOCK, [memoryview(data)], direct=False)
        assert np.array_equal(data, block_content(a, BLOCK))

    run_with_tiers(tmp_path, body)


def test_a_promotion_reads_into_its_pages_once_the_copy_of_their_victim_has_landed(tmp_path):
    """A's promotion evicts B from the pool, whose copy out of the pages (held here) must land before
    A's file is read into them: B's file holds B's bytes, and A is promoted intact."""
    a, b, c, d, e = chain_hashes("promotion-after-copy", 5)

    async def body(t: Tiers) -> None:
        await t.demote_first([a, b, c, d, e])  # A goes to disk; B is the pool's least recently used
        gate = threading.Event()
        t.fs.copier.submit(gate.wait)
        try:
            t.fs.lookup(t.ns, [a])
            promotion = asyncio.ensure_future(t.fs.promote(t.ns, [a]))
            await asyncio.sleep(0.05)
            assert not promotion.done() and b not in t.ns.blocks
        finally:
            gate.set()
        await asyncio.wait_for(promotion, timeout=10)
        await t.settle()
        in_pool = t.pool.view.read_blocks(np.frombuffer(t.ns.blocks[a].pages, dtype="<u4").reshape(1, -1), BLOCK)
        assert np.array_equal(in_pool[0], block_content(a, BLOCK))
        data = aligned_empty(BLOCK)
        read_block(t.path(b), t.ns.id, b, BLOCK, [memoryview(data)], direct=False)
        assert np.array_equal(data, block_content(b, BLOCK))

    run_with_tiers(tmp_path, body)


def test_a_promotion_does_not_wait_behind_queued_writes(tmp_path):
    """Every writing thread busy (a burst of demotions on a slow disk): a load's reads still go on."""
    a, b, c, d, e = chain_hashes("not-behind-writes", 5)

    async def body(t: Tiers) -> None:
        await t.demote_first([a, b, c, d, e])  # A goes to disk
        gate = hold_io_threads(t.fs, readers=False)
        try:
            await asyncio.wait_for(t.fs.promote(t.ns, [a]), timeout=10)
        finally:
            gate.set()
        assert a in t.ns.blocks

    run_with_tiers(tmp_path, body)


@pytest.mark.parametrize("failure", ["no memory for a staging buffer", "the copy out of the pool fails"])
def test_a_failed_demotion_leaves_every_account_straight(tmp_path, monkeypatch, failure):
    """A demotion fails before its write starts: the block goes unwritten, and the pool, the tier's
    bytes and the staging queue are as if it had never been tried; later ones go on."""
    a, b, c, d, e, f = chain_hashes(f"failed-demotion-{failure}", 6)

    def fails(*args, **kwargs):
        raise MemoryError if failure.startswith("no memory") else RuntimeError("copy failed")

    async def body(t: Tiers) -> None:
        with monkeypatch.context() as patch:
            if failure.startswith("no memory"):
                patch.setattr(fs_staging, "aligned_empty", fails)  # (made ahead or not, no buffer can be had)
            for block_hash in (a, b, c, d):
                await t.put(block_hash, 0)
            if not failure.startswith("no memory"):
                await t.settle()  # (staging buffers made ahead)
                patch.setattr(t.pool.view, "read_blocks", fails)
            await t.put(e, 0)  # A is evicted from the pool, not written
        await t.settle()
        assert a not in t.ns.blocks and t.fs.index.get(t.ns.id, a) is None and not t.fs._writes
        assert t.fs.index.inflight_bytes == 0 and t.fs.staging.queued == 0
        assert t.fs.health.skipped["no_memory"] == (1 if failure.startswith("no memory") else 0)
        assert t.store.pages.free == 0 and len(t.ns.blocks) == 4  # B, C, D, E: A's pages went to E
        await t.put(f, 1)  # B goes to disk as usual
        assert t.fs.index.get(t.ns.id, b) is not None

    run_with_tiers(tmp_path, body)


@pytest.fixture
def read_only(monkeypatch) -> threading.Event:
    """Set: the tier's filesystem refuses every change with EROFS (ext4's errors=remount-ro)."""
    turned = threading.Event()
    real_rename, real_open, real_unlink = os.rename, os.open, Path.unlink

    def refused(path) -> OSError:
        return OSError(errno.EROFS, "Read-only file system", str(path))

    def rename(src, dst, *args, **kwargs):
        if turned.is_set():
            raise refused(src)
        return real_rename(src, dst, *args, **kwargs)

    def open_(path, flags, *args, **kwargs):
        if turned.is_set() and flags & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
            raise refused(path)
        return real_open(path, flags, *args, **kwargs)

    def unlink(path, missing_ok=False):
        if turned.is_set():
            raise refused(path)
        return real_unlink(path, missing_ok=missing_ok)

    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(os, "open", open_)
    monkeypatch.setattr(Path, "unlink", unlink)
    return turned


def test_a_full_tier_whose_disk_turns_read_only_keeps_serving_the_blocks_it_holds(tmp_path, read_only):
    """A full tier's write evicts blocks to make room, then fails: the disk turned read-only. The
    evicted blocks' files are intact (the disk refused to remove them too), so they stay in the index
    and load, instead of being dropped one write at a time. The victim goes back where it was, the
    next to be evicted, not as if just used."""
    a, b, c, d, e, f, g = chain_hashes("read-only", 7)

    async def body(t: Tiers) -> None:
        await t.demote_first([a, b, c, d, e])
        await t.put(f, 2)  # A and B on disk: the tier is full
        await t.settle()
        read_only.set()
        await t.put(g, 0)  # the pool evicts C: its write evicts A (the least recently used) and fails
        await t.settle()
        assert t.fs.health.paused and t.fs.health.write_errors == 1 and t.fs.index.get(t.ns.id, c) is None
        assert {h for h in (a, b) if t.fs.index.get(t.ns.id, h) is not None} == {a, b}
        assert t.fs.index.used_bytes == 2 * charged_bytes(BLOCK)
        victim = t.fs.index.policy.pop_victim()
        assert victim == t.fs.index.get(t.ns.id, a).slot
        t.fs.index.policy.unevict(victim, (t.ns.id, a))
        read_only.clear()
        t.fs.lookup(t.ns, [a])
        await t.fs.promote(t.ns, [a])  # (its reservation evicts D from the pool, unwritten: stores are paused)
        assert a in t.ns.blocks

    run_with_tiers(tmp_path, body)


def test_blocks_cleared_while_a_write_that_evicted_them_fails_stay_deleted(tmp_path, read_only):
    """The blocks a write evicted are out of the index while it runs, out of reach of a Clear: should
    the write then fail on a read-only disk, the Clear meanwhile keeps them from coming back."""
    a, b, c, d, e, f, g = chain_hashes("read-only-clear", 7)

    async def body(t: Tiers) -> None:
        await t.demote_first([a, b, c, d, e])
        await t.put(f, 2)
        await t.settle()
        read_only.set()
        gate = hold_io_threads(t.fs, readers=False)
        await t.put(g, 0)  # the pool evicts C: its write evicts A or B, and waits at the gate
        assert len(t.fs.index) == 1
        t.fs.clear(t.ns.id)
        t.store.clear(t.ns)
        gate.set()
        await t.settle()
        read_only.clear()
        assert len(t.fs.index) == 0 and t.fs.lookup(t.ns, [a])[0] == 0 and t.fs.lookup(t.ns, [b])[0] == 0

    run_with_tiers(tmp_path, body)


def test_files_still_being_removed_count_against_the_tier_size(tmp_path, monkeypatch):
    """Clear takes its blocks out of the index at once, but their files go in a job on an I/O thread
    (slow here, as with many files). Until they are gone they keep their room: demotions meanwhile
    are skipped as if the tier were full, rather than written beside them, past --fs-size."""
    a, b, c, d, e, f, g, h, i, j, k = chain_hashes("removing", 11)
    gate, held = threading.Event(), set()
    real_unlink_all = FsTier._unlink_all

    def slow_unlink_all(tier: FsTier, paths: list[Path]) -> None:
        if held.intersection(paths):
            gate.wait()
        real_unlink_all(tier, paths)

    monkeypatch.setattr(FsTier, "_unlink_all", slow_unlink_all)

    def bytes_on_disk(root: Path) -> int:
        return sum(path.stat().st_size for path in root.rglob("*") if path.suffix in (".kvb", ".tmp"))

    async def body(t: Tiers) -> None:
        await t.demote_first([a, b, c, d, e])
        await t.put(f, 2)  # A and B on disk: the tier is full
        await t.settle()
        held.update({t.path(a), t.path(b)})
        try:
            t.store.clear(t.ns)
            t.fs.clear(t.ns.id)
            for block_hash in (g, h, i, j, k):  # K's reservation evicts G from the pool
                await t.put(block_hash, 0)
            await asyncio.sleep(0.05)
            assert bytes_on_disk(t.fs.root) <= t.fs.settings.capacity and t.fs.health.skipped["tier_full"] >= 1
            assert t.fs.index.used_bytes == 2 * charged_bytes(BLOCK)
        finally:
            gate.set()
        await t.settle()
        assert t.fs.index.removing_bytes == 0 and not t.path(a).exists() and not t.path(b).exists()

    run_with_tiers(tmp_path, body)


def test_a_crash_before_a_queued_removal_leaves_no_file_the_index_file_hides(tmp_path, monkeypatch):
    """A block deleted, its file's removal still queued, when the index file is written: should the
    daemon die before the removal, its next start must see the file (its directory listed, not taken
    from the index file), or it would sit on disk uncounted against --fs-size, never removed."""
    a, b, c, d, e = chain_hashes("removal-queued", 5)
    gate, held = threading.Event(), set()

    def held_unlink_all(tier: FsTier, paths: list[Path]) -> None:
        if held.intersection(paths):
            gate.wait()
        real_unlink_all(tier, paths)

    real_unlink_all = FsTier._unlink_all
    monkeypatch.setattr(FsTier, "_unlink_all", held_unlink_all)

    async def body(t: Tiers) -> None:
        await t.demote_first([a, b, c, d, e])  # A goes to disk
        await asyncio.sleep(RACY_SECONDS + 0.1)  # (a directory changed since is never taken from the index file)
        held.add(t.path(a))
        try:
            t.fs.delete(t.ns.id, [a])  # its file's removal waits at the gate
            await t.fs.save_index()
            restarted = FsTier(t.fs.settings, t.pool, BlockStore(num_pages=4, page_size=BLOCK))
            restarted.open()  # as after a crash now
            restarted.executor.shutdown()
            restarted.readers.shutdown()
            assert t.path(a).exists() and restarted.index.get(t.ns.id, a) is not None
        finally:
            gate.set()

    run_with_tiers(tmp_path, body)


def test_a_file_the_disk_refuses_to_remove_is_found_by_the_next_start(tmp_path, monkeypatch):
    """A deleted block whose file the disk refuses to remove (EIO) is out of the index but on disk:
    index files must leave its directory out from then on, or every later start would take the
    directory from the index file and never see the file (uncounted against --fs-size, never
    removed). The next start lists it, counts the file, and can remove it."""
    a, b, c, d, e = chain_hashes("unremovable", 5)
    real_unlink = Path.unlink

    def failing_unlink(path: Path, missing_ok: bool = False) -> None:
        if path.suffix == ".kvb":
            raise OSError(errno.EIO, "Input/output error", str(path))
        real_unlink(path, missing_ok=missing_ok)

    async def body(t: Tiers) -> None:
        await t.demote_first([a, b, c, d, e])  # A goes to disk
        await asyncio.sleep(RACY_SECONDS + 0.1)  # (a directory changed since is never taken from the index file)
        with monkeypatch.context() as patch:
            patch.setattr(Path, "unlink", failing_unlink)
            t.fs.delete(t.ns.id, [a])
            await t.settle()
        assert t.path(a).exists() and t.fs.index.get(t.ns.id, a) is None
        await asyncio.sleep(RACY_SECONDS + 0.1)
        await t.fs.save_index()
        restarted = FsTier(t.fs.settings, t.pool, BlockStore(num_pages=4, page_size=BLOCK))
        restarted.open()
        restarted.executor.shutdown()
        restarted.readers.shutdown()
        assert restarted.index.get(t.ns.id, a) is not None

    run_with_tiers(tmp_path, body)


def test_staging_buffers_are_made_ahead_on_an_io_thread(tmp_path, monkeypatch):
    """The first commit of a block size has the staging buffers that fit --fs-queue-size made and
    touched on an I/O thread; demotions then take them, allocating nothing on the event loop."""
    a, b, c, d, e, f = chain_hashes("made-ahead", 6)
    loop_thread = threading.get_ident()
    made_on = []

    def aligned_empty(size):
        made_on.append(threading.get_ident())
        return real_aligned_empty(size)

    real_aligned_empty = fs_staging.aligned_empty
    monkeypatch.setattr(fs_staging, "aligned_empty", aligned_empty)

    async def body(t: Tiers) -> None:
        await t.put(a, 0)
        await t.settle()
        assert t.fs.staging.kept == t.fs.settings.queue_bytes and len(made_on) == 8
        for block_hash in (b, c, d, e, f):
            await t.put(block_hash, 2 if block_hash == f else 0)
        assert len(made_on) == 8 and loop_thread not in made_on

    run_with_tiers(tmp_path, body)


@pytest.mark.parametrize("ending", ["caller-cancelled", "session-ended"])
def test_a_pinned_lookup_ended_during_its_promotion_leaves_no_lease(tmp_path, ending):
    """A pinned lookup whose prefix runs from the pool onto the disk pins the pool part, then waits for
    the promotion: if its caller is cancelled (a deadline) or its session ends meanwhile, the pool
    part is let go at once, not held until the lease's time runs out."""
    a, b, c, d, e = chain_hashes(f"lease-{ending}", 5)

    async def body(t: Tiers) -> None:
        await t.demote_first([a, b, c, d, e])  # A goes to disk; E is in the pool
        service, session = t.data_service(daemon_limits())
        gate = hold_io_threads(t.fs)
        find = asyncio.ensure_future(service._find(session.id, t.ns, [e, a], pin=True))
        await asyncio.sleep(0.05)
        assert len(t.store._leases) == 1  # E pinned, A being read
        if ending == "caller-cancelled":
            find.cancel()
        else:
            service.sessions.close(session.id)
            t.store.drop_session(session.id)
        gate.set()
        with pytest.raises(asyncio.CancelledError if ending == "caller-cancelled" else Unauthenticated):
            await find
        await t.settle()
        assert not t.store._leases and a in t.ns.blocks  # (the promotion itself went through)

    run_with_tiers(tmp_path, body)


def test_a_block_written_again_waits_for_the_removal_of_its_old_file(tmp_path, monkeypatch):
    """A's file is taken over by a later write (A evicted from the full disk) whose thread starts late;
    meanwhile the pool evicts A too, and A is written again under the same name. The new file must
    not be what the late write renames away: A's write waits for it."""
    a, b, c, d, e, f, g, h = chain_hashes("written-again", 8)
    gate, held = threading.Event(), set()

    def held_write_block_file(*args, reuse=None, **kwargs):
        if reuse in held:
            gate.wait()
        real_write_block_file(*args, reuse=reuse, **kwargs)

    real_write_block_file = fs_tier.write_block_file
    monkeypatch.setattr(fs_tier, "write_block_file", held_write_block_file)

    async def body(t: Tiers) -> None:
        await t.demote_first([a, b, c, d, e])  # A goes to disk
        await t.put(f, 2)  # then B: the tier is full
        t.fs.lookup(t.ns, [a])
        await t.fs.promote(t.ns, [a])  # A in the pool and on disk; C's demotion took B's file
        await t.settle()
        held.add(t.path(a))
        try:
            await t.put(g, 1)  # D's demotion takes A's file (the disk's least recently used): held
            assert t.fs.index.get(t.ns.id, a) is None
            t.store.lookup("s", t.ns, [e, f, g], pin=False)
            await t.put(h, 0)  # the pool evicts A: written again, under the name D's write still has to take
            await asyncio.sleep(0.05)
        finally:
            gate.set()
        await t.settle()
        assert t.fs.index.get(t.ns.id, a) is not None and t.fs.index.get(t.ns.id, d) is not None
        for block_hash in (a, d):
            data = aligned_empty(BLOCK)
            read_block(t.path(block_hash), t.ns.id, block_hash, BLOCK, [memoryview(data)], direct=False)
            assert np.array_equal(data, block_content(block_hash, BLOCK))

    run_with_tiers(tmp_path, body)


def test_a_pinned_lookup_batch_whose_session_ends_before_its_lookups_run_pins_nothing(tmp_path):
    """With the disk tier a pinned LookupBatch looks its queries up in tasks of their own; should the
    session end before they run, they pin nothing (the session's end let go of its holds already)."""
    a, b, c, d, e = chain_hashes("batch-session", 5)

    async def body(t: Tiers) -> None:
        await t.demote_first([a, b, c, d, e])  # E is in the pool
        service, session = t.data_service(daemon_limits(max_batch_blocks=64))
        session.namespaces.add(t.ns.id)
        request = pb.LookupBatchRequest(session_id=session.id, namespace=t.ns.id, queries=[e, e], pin=True)
        call = asyncio.ensure_future(DataService.LookupBatch.__wrapped__(service, request, None))  # (no gRPC wrapper)
        await asyncio.sleep(0)  # the call has made its lookups' tasks, which have not run
        service.sessions.close(session.id)
        t.store.drop_session(session.id)
        with pytest.raises(Unauthenticated):
            await call
        assert not t.store._leases

    run_with_tiers(tmp_path, body)


def test_a_pinned_lookup_batch_whose_namespace_is_retired_before_its_lookups_run_pins_nothing(tmp_path):
    """Another call of the session leaves the namespace and a Register retires it before the batch's
    lookup tasks run: they refuse (NOT_FOUND) instead of promoting the blocks on disk into the retired
    namespace, whose pages nothing would count or free, under a lease on a namespace the store no
    longer knows."""
    a, b, c, d, e = chain_hashes("batch-retired", 5)

    async def body(t: Tiers) -> None:
        await t.demote_first([a, b, c, d, e])  # A is on disk only
        service, session = t.data_service(daemon_limits(max_batch_blocks=64))
        session.namespaces.add(t.ns.id)
        request = pb.LookupBatchRequest(session_id=session.id, namespace=t.ns.id, queries=[a + b], pin=True)
        call = asyncio.ensure_future(DataService.LookupBatch.__wrapped__(service, request, None))  # (no gRPC wrapper)
        await asyncio.sleep(0)  # the call has made its lookups' tasks, which have not run
        session.namespaces.discard(t.ns.id)  # (Register with `replaces`, then a Register at --max-namespaces)
        t.store.retire(t.ns)
        with pytest.raises(NotFound):
            await call
        await t.settle()
        usage = t.store.usage()
        assert not t.store._leases and usage.used_pages == usage.committed_pages == 0 and not t.ns.blocks

    run_with_tiers(tmp_path, body)


def test_a_lease_promoted_from_disk_has_its_whole_time_to_live_when_answered(tmp_path):
    """The lease is made when the pool part is found, before the disk part is read: its time to
    live starts again once the read is done, as the answer announces it whole."""
    a, b, c, d, e = chain_hashes("renewed", 5)

    async def body(t: Tiers) -> None:
        await t.demote_first([a, b, c, d, e])  # A goes to disk; E is in the pool
        service, session = t.data_service(daemon_limits())
        gate = hold_io_threads(t.fs)
        find = asyncio.ensure_future(service._find(session.id, t.ns, [e, a], pin=True))
        await asyncio.sleep(0.3)  # A's read held
        gate.set()
        hit, lease = await find
        assert hit == 2 and lease.expires_at >= time.monotonic() + t.store.lease_ttl - 0.1
        t.store.release(session.id, lease.id)
        await t.settle()

    run_with_tiers(tmp_path, body)


def test_a_pinned_lookup_batch_ended_during_a_promotion_leaves_no_lease(tmp_path):
    """LookupBatch(pin): one query is answered from the pool at once (pinned), another waits for its
    promotion when the call is cancelled (its deadline): the answered query's pins go too."""
    a, b, c, d, e = chain_hashes("batch-lease", 5)

    async def body(t: Tiers) -> None:
        await t.demote_first([a, b, c, d, e])  # A goes to disk; E is in the pool
        service, session = t.data_service(daemon_limits(max_batch_blocks=64))
        session.namespaces.add(t.ns.id)
        request = pb.LookupBatchRequest(session_id=session.id, namespace=t.ns.id, queries=[e, a], pin=True)
        gate = hold_io_threads(t.fs)
        call = asyncio.ensure_future(DataService.LookupBatch.__wrapped__(service, request, None))  # (no gRPC wrapper)
        await asyncio.sleep(0.05)
        assert len(t.store._leases) == 1  # E's query answered and pinned, A's waiting for its read
        call.cancel()
        gate.set()
        with pytest.raises(asyncio.CancelledError):
            await call
        await t.settle()
        assert not t.store._leases

    run_with_tiers(tmp_path, body)


def test_a_tier_directory_that_cannot_be_listed_starts_empty_and_the_daemon_goes_on(tmp_path, monkeypatch):
    """The tier's directory fails to list at start (EIO): the tier starts empty instead of stopping
    the daemon, and demotes as usual once the disk answers again."""
    root = tmp_path / "fs"
    root.mkdir()
    (root / "index.kvi.1.tmp").write_bytes(b"an interrupted index file write")
    failing = {str(root)}

    def refuse(real):
        def listing(path="."):
            if os.fspath(path) in failing:
                raise OSError(errno.EIO, "Input/output error", os.fspath(path))
            return real(path)

        return listing

    monkeypatch.setattr(os, "listdir", refuse(os.listdir))
    monkeypatch.setattr(os, "scandir", refuse(os.scandir))
    a, b, c, d, e = chain_hashes("unlistable", 5)

    async def body(t: Tiers) -> None:
        assert len(t.fs.index) == 0
        failing.clear()
        await t.demote_first([a, b, c, d, e])  # A goes to disk
        assert t.path(a).exists()

    run_with_tiers(tmp_path, body)


def test_a_file_that_fails_to_read_is_removed_not_left_unlisted(tmp_path, monkeypatch):
    """A read failing with EIO drops the block from the index and removes its file too: left on disk,
    the next index file would hide it, uncounted against --fs-size and never removed."""
    a, b, c, d, e = chain_hashes("unreadable", 5)

    def failing_read(path, *args):
        raise OSError(errno.EIO, "Input/output error", str(path))

    async def body(t: Tiers) -> None:
        await t.demote_first([a, b, c, d, e])  # A goes to disk
        monkeypatch.setattr(fs_tier, "read_block", failing_read)
        stored = t.ns.counters.stored_blocks
        await t.fs.promote(t.ns, [a])
        await t.settle()
        assert a not in t.ns.blocks and t.fs.index.get(t.ns.id, a) is None and t.fs.health.read_errors == 1
        assert not t.path(a).exists()
        assert t.ns.counters.stored_blocks == stored and t.fs.index.counters[t.ns.id].loaded_blocks == 0  # (not counted)

    run_with_tiers(tmp_path, body)


def test_a_cleared_namespace_has_no_file_left_once_gone_returns(tmp_path):
    """A block of the cleared namespace evicted from disk for another namespace's write that still
    waits behind queued writes: its file, out of the index, is still there. Clear must not answer
    before it is gone (a daemon killed then would index and serve it again)."""
    a1, a2 = chain_hashes("clear-a", 2)
    b = chain_hashes("clear-b", 5)
    found_again = {}

    async def body(t: Tiers) -> None:
        ns_a = t.ns
        ns_b = t.store.register(spec(block_bytes=ns_a.block_bytes, model_id="other-model"))
        await t.put(a1, 0)
        await t.put(a2, 0)
        t.ns = ns_b
        for i, block_hash in enumerate(b[:4]):
            await t.put(block_hash, max(0, i - 1))  # b[2], b[3] evict a1, a2 from the pool: both on disk
        while len(t.fs.index) < 2 or t.fs._jobs:
            await asyncio.sleep(0.005)
        assert t.fs.index.get(ns_a.id, a1) and t.fs.index.get(ns_a.id, a2)
        gate = hold_io_threads(t.fs, readers=False)
        try:
            await t.put(b[4], 0)  # evicts b[0] from the pool (B's oldest); its write (held) evicts a1's file from the tier
            assert t.fs.index.get(ns_a.id, a1) is None and block_path(t.fs.root, ns_a.id, a1).exists()
            deletion = t.fs.clear(ns_a.id)  # as the admin Clear does
            await asyncio.wait_for(t.fs.gone(deletion), 5)  # the Clear answers now
            # the daemon is killed here: what does its next start find?
            fresh = FsTier(t.fs.settings, t.pool, BlockStore(num_pages=4, page_size=ns_a.block_bytes))
            fresh.open()
            found_again["a1"] = fresh.index.get(ns_a.id, a1) is not None
            found_again["a2"] = fresh.index.get(ns_a.id, a2) is not None
            fresh.executor.shutdown()
        finally:
            gate.set()

    run_with_tiers(tmp_path, body)
    assert found_again == {"a1": False, "a2": False}, found_again


def test_an_evicted_block_name_holding_a_directory_is_replaced_without_pausing_stores(tmp_path):
    """A directory put by hand under an evicted block's name, reused for a new block's file: it is
    removed and a new file written (unlinking it failed, and the whole tier paused its stores)."""
    a, b, c, d, e, f, g = chain_hashes("dir-reuse", 7)
    outcome = {}

    async def body(t: Tiers) -> None:
        await t.demote_first([a, b, c, d, e])  # A on disk
        await t.put(f, 2)  # B on disk: the tier is full, A its least recently used
        path = t.path(a)
        path.unlink()
        path.mkdir()  # (put there by hand, as the FIFO of the commit's own test)
        await t.put(g, 0)  # C's demotion evicts A and reuses its "file"
        await t.settle()
        outcome.update(
            paused=t.fs.health.paused, write_errors=t.fs.health.write_errors, c_on_disk=t.fs.index.get(t.ns.id, c) is not None
        )

    run_with_tiers(tmp_path, body)
    assert outcome == {"paused": False, "write_errors": 0, "c_on_disk": True}, outcome
