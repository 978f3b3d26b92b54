"""The filesystem tier through the real daemon: real files under a temporary directory, real gRPC."""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import msgpack
import numpy as np
import pytest
from blocks import block_content, chain_hashes, contents, spec
from daemon import DaemonProcess, new_daemon_dir
from test_admin import ctl

from kvtier.client import KVTierClient
from kvtier.v1 import kvtier_pb2 as pb
from kvtierd import fs_format
from kvtierd.config import load_config
from kvtierd.fs_snapshot import RACY_SECONDS

BLOCK = 256 * 1024  # 16 blocks fill the 4 MiB pools below
SMALL = 4096


def fs_stats(daemon: DaemonProcess, namespace: str = "") -> pb.TierStats:
    return next(t for t in daemon.admin("GetStats", namespace=namespace).tiers if t.tier == "fs")


def wait_on_disk(daemon: DaemonProcess, blocks: int, timeout: float = 20.0) -> pb.TierStats:
    """Demotions are asynchronous: wait until the tier holds `blocks` blocks."""
    deadline = time.monotonic() + timeout
    while (stats := fs_stats(daemon)).blocks < blocks:
        assert time.monotonic() < deadline, f"only {stats.blocks} of {blocks} blocks reached the disk"
        time.sleep(0.02)
    return stats


def written_then_stopped(fs_daemons, hashes: list[bytes], block_bytes: int = BLOCK, *args: str) -> tuple[DaemonProcess, str]:
    """A daemon (with `args`) that wrote the blocks `hashes` through to disk and stopped; and their
    namespace's id."""
    daemon = fs_daemons("--fs-write-through", "true", *args)
    with KVTierClient(daemon.address) as client:
        ns = client.register(spec(block_bytes=block_bytes))
        client.store(ns, hashes, contents(hashes, block_bytes))
        wait_on_disk(daemon, len(hashes))
    assert daemon.stop() == 0
    return daemon, ns.id


def block_file(daemon: DaemonProcess, namespace: str, block_hash: bytes) -> Path:
    return daemon.directory / "fs" / namespace / block_hash.hex()[0] / (block_hash.hex() + ".kvb")


def gone(path: Path, timeout: float = 5.0) -> bool:
    """Files are removed on the I/O threads, shortly after the call that dropped them returned."""
    deadline = time.monotonic() + timeout
    while path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    return not path.exists()


def test_evicted_blocks_round_trip_through_disk(fs_daemons):
    daemon = fs_daemons()
    with KVTierClient(daemon.address) as client:
        ns = client.register(spec(block_bytes=BLOCK))
        hashes = chain_hashes("demote", 40)
        data = contents(hashes, BLOCK)
        for start in range(0, 40, 8):
            assert client.store(ns, hashes[start : start + 8], data[start : start + 8]) == 8
        stats = wait_on_disk(daemon, 24)  # the pool holds the last 16; the first 24 were evicted and demoted
        assert stats.stored_blocks == 24 and stats.bytes == 24 * BLOCK
        assert all(block_file(daemon, ns.id, h).is_file() for h in hashes[:24])
        ram = daemon.admin("GetStats").tiers[0]
        assert ram.evictions == 24 and ram.blocks == 16
        assert client.lookup(ns, hashes).hit_count == 40  # prefix on disk, continued in the pool
        for start in range(0, 24, 8):  # promotion: read back into the pool, byte-exact, both transports
            transport = "inline" if start == 8 else "shm"
            assert np.array_equal(client.load(ns, hashes[start : start + 8], transport=transport), data[start : start + 8])
        assert fs_stats(daemon).loaded_blocks == 24


def test_pinned_lookups_promote_in_parallel_and_pin_the_whole_prefix(fs_daemons):
    daemon = fs_daemons("--fs-write-through", "true", "--fs-io-threads", "4")
    with KVTierClient(daemon.address) as client:
        ns = client.register(spec(block_bytes=BLOCK))
        first, second = chain_hashes("p-a", 6), chain_hashes("p-b", 4)
        client.store(ns, first, contents(first, BLOCK))
        client.store(ns, second, contents(second, BLOCK))
        wait_on_disk(daemon, 10)
        filler = chain_hashes("p-filler", 16)  # pushes every block above out of the pool
        client.store(ns, filler, contents(filler, BLOCK))
        wait_on_disk(daemon, 26)  # written through: the fillers are held in the pool until then
        assert client.lookup(ns, first).hit_count == 6
        assert daemon.admin("GetStats").tiers[0].blocks == 16
        results = client.lookup_batch(ns, [first, second + chain_hashes("p-none", 2)], pin=True)
        assert [r.hit_count for r in results] == [6, 4]
        assert daemon.admin("GetStats").pinned_blocks == 10
        for result, hashes in zip(results, (first, second), strict=True):
            assert np.array_equal(client.load(ns, lease_id=result.lease_id, transport="inline"), contents(hashes, BLOCK))
            assert np.array_equal(result.checksums, contents_checksums(hashes))
        assert fs_stats(daemon).loaded_blocks == 10
        assert daemon.admin("GetStats").pinned_blocks == 0


def test_a_pinned_lookup_promoting_blocks_keeps_its_own_prefix_in_the_pool(fs_daemons):
    """The pool holds a prefix's last block, the disk its first ones: making room for those, the
    promotion evicts other blocks, not the prefix's own (it then pinned one block fewer than found)."""
    daemon = fs_daemons()  # (a pool of four 1 MiB blocks)
    block = 1 << 20
    with KVTierClient(daemon.address) as client:
        ns = client.register(spec(block_bytes=block))
        prefix, others = chain_hashes("own-p", 4), chain_hashes("own-o", 3)
        client.store(ns, prefix, contents(prefix, block))
        client.store(ns, others, contents(others, block))  # the prefix's first three go to disk
        wait_on_disk(daemon, 3)
        assert client.lookup(ns, prefix).hit_count == 4  # the last one is the pool's least recently used
        pinned = client.lookup(ns, prefix, pin=True)
        assert pinned.hit_count == 4
        assert np.array_equal(client.load(ns, lease_id=pinned.lease_id, transport="inline"), contents(prefix, block))
        assert daemon.admin("GetStats").pinned_blocks == 0


def contents_checksums(hashes: list[bytes]) -> np.ndarray:
    from kvtier import checksum

    return checksum.block_checksums(contents(hashes, BLOCK))


def test_restart_serves_the_same_blocks_byte_exact(fs_daemons):
    daemon = fs_daemons("--fs-write-through", "true", "--fs-direct-io", "true")
    with KVTierClient(daemon.address) as client:
        ns = client.register(spec(block_bytes=BLOCK))
        odd = client.register(spec(block_bytes=5000, model_id="odd-size"))
        hashes, odd_hashes = chain_hashes("restart", 12), chain_hashes("restart-odd", 5)
        client.store(ns, hashes, contents(hashes, BLOCK))
        client.store(odd, odd_hashes, contents(odd_hashes, 5000))
        wait_on_disk(daemon, 17)
    assert daemon.stop() == 0
    old_layout = daemon.directory / "fs" / ns.id / "a7"  # a fan-out directory of the first layout (256 of them)
    old_layout.mkdir()
    (old_layout / ("a7" * 32 + ".kvb")).write_bytes(b"x" * 4096)
    again = fs_daemons("--fs-direct-io", "true", directory=daemon.directory)
    assert "direct_io=True" in again.log()
    assert not old_layout.exists()
    models = {n.spec.model_id: n for n in again.admin("ListNamespaces").namespaces}
    assert models["test-model"].namespace == ns.id and models["odd-size"].namespace == odd.id  # known from disk
    assert fs_stats(again).blocks == 17
    with KVTierClient(again.address) as client:
        assert client.register(spec(block_bytes=BLOCK)).id == ns.id
        client.register(spec(block_bytes=5000, model_id="odd-size"))
        assert client.lookup(ns, hashes).hit_count == 12
        assert np.array_equal(client.load(ns, hashes), contents(hashes, BLOCK))
        assert np.array_equal(client.load(odd, odd_hashes, transport="inline"), contents(odd_hashes, 5000))
    inspected = again.admin("InspectBlock", namespace=ns.id, hash=hashes[0], tier="fs")
    assert inspected.block.tier == "fs" and inspected.block.created_at > 0
    assert inspected.checksum == inspected.stored_checksum != 0


def test_a_restart_registers_only_the_namespaces_holding_blocks_on_disk(fs_daemons):
    """A namespace whose blocks are all gone (cleared, or evicted from the tier: after an upgrade
    that changed how engines name their namespaces, say) is not registered again at start, where
    it would take one of --max-namespaces for good; its engines can still register it."""
    daemon = fs_daemons("--fs-write-through", "true")
    with KVTierClient(daemon.address) as client:
        kept = client.register(spec(block_bytes=BLOCK, model_id="kept"))
        cleared = client.register(spec(block_bytes=BLOCK, model_id="cleared"))
        for ns in (kept, cleared):
            client.store(ns, chain_hashes(ns.id, 3), contents(chain_hashes(ns.id, 3), BLOCK))
        wait_on_disk(daemon, 6)
    daemon.admin("Clear", namespace=cleared.id)
    assert daemon.stop() == 0
    assert (daemon.directory / "fs" / cleared.id).is_dir()  # (its directory stays)
    again = fs_daemons("--max-namespaces", "2", directory=daemon.directory)
    assert [n.namespace for n in again.admin("ListNamespaces").namespaces] == [kept.id]
    with KVTierClient(again.address) as client:
        assert client.register(spec(block_bytes=BLOCK, model_id="cleared")).id == cleared.id
        ns = client.register(spec(block_bytes=BLOCK, model_id="kept"))
        assert client.lookup(ns, chain_hashes(kept.id, 3)).hit_count == 3


@pytest.mark.parametrize("stray", [False, True])
def test_an_empty_namespace_directory_goes_at_start_and_one_that_cannot_go_is_written_again(fs_daemons, stray):
    """A namespace left without blocks on disk (cleared) has its directory removed at the next start.
    A file that is not a block (an operator's, an NFS leftover) keeps the directory: its engines'
    writes then make the spec and the fan-out directories again, and no write fails."""
    daemon = fs_daemons("--fs-write-through", "true")
    with KVTierClient(daemon.address) as client:
        ns = client.register(spec(block_bytes=BLOCK))
        client.store(ns, chain_hashes("emptied", 2), contents(chain_hashes("emptied", 2), BLOCK))
        wait_on_disk(daemon, 2)
    daemon.admin("Clear", namespace=ns.id)
    assert daemon.stop() == 0
    directory = daemon.directory / "fs" / ns.id
    if stray:
        (directory / "7" / "notes.txt").write_text("kept")
    again = fs_daemons("--fs-write-through", "true", directory=daemon.directory)
    assert directory.exists() == stray
    with KVTierClient(again.address) as client:
        ns = client.register(spec(block_bytes=BLOCK))
        hashes = chain_hashes("written-again", 8)
        client.store(ns, hashes, contents(hashes, BLOCK))
        stats = wait_on_disk(again, 8)
    assert (stats.io_errors, stats.stores_paused) == (0, False)


def stored_on_disk(fs_daemons, seed: str, count: int, *args: str):
    """A daemon with --fs-write-through (and `args`) that stored `count` blocks, all of them on disk by now."""
    daemon = fs_daemons("--fs-write-through", "true", *args)
    with KVTierClient(daemon.address) as client:
        ns = client.register(spec(block_bytes=BLOCK))
        hashes = chain_hashes(seed, count)
        data = contents(hashes, BLOCK)
        client.store(ns, hashes, data)
        wait_on_disk(daemon, count)
    return daemon, ns, hashes, data


def test_restart_takes_the_index_file_and_lists_only_changed_directories(fs_daemons):
    daemon, ns, hashes, data = stored_on_disk(fs_daemons, "index-file", 12)
    time.sleep(RACY_SECONDS + 0.1)  # directories modified since are not recorded (their mtime could still repeat)
    assert daemon.stop() == 0
    index_file = daemon.directory / "fs" / "index.kvi"
    assert index_file.is_file()

    daemon = fs_daemons(directory=daemon.directory)
    assert "directories_listed=0 directories_from_index_file=16" in daemon.log()
    assert fs_stats(daemon).blocks == 12
    with KVTierClient(daemon.address) as client:
        ns = client.register(spec(block_bytes=BLOCK))
        assert np.array_equal(client.load(ns, hashes[:8]), data[:8])
    time.sleep(RACY_SECONDS + 0.1)
    assert daemon.stop() == 0
    block_file(daemon, ns.id, hashes[3]).unlink()  # while the daemon is down: its directory's mtime moves

    daemon = fs_daemons(directory=daemon.directory)
    assert "directories_listed=1 directories_from_index_file=15" in daemon.log()
    assert fs_stats(daemon).blocks == 11
    listed = {b.hash for b in daemon.admin("ListBlocks", tier="fs", page_size=100).blocks}
    assert hashes[3] not in listed and len(listed) == 11
    with KVTierClient(daemon.address) as client:
        ns = client.register(spec(block_bytes=BLOCK))
        assert client.lookup(ns, hashes).hit_count == 3
    assert daemon.stop() == 0
    index_file.write_bytes(index_file.read_bytes()[:-1] + b"?")  # a damaged index file is not trusted

    daemon = fs_daemons(directory=daemon.directory)
    assert "ignoring the fs index file" in daemon.log() and "directories_listed=16" in daemon.log()
    assert fs_stats(daemon).blocks == 11


@pytest.mark.parametrize("fs_size", ["192MiB", "12MiB"])
def test_kill_9_during_heavy_writes_never_serves_wrong_bytes(fs_daemons, fs_size):
    """Kill the daemon at random moments while an engine stores blocks (written through and demoted)
    as fast as it can, 20 times over the same directory. After every restart each block the tier
    offers must load byte-exact (content is derived from the hash), and no temporary file may be left.
    A kill -9 loses nothing the kernel already has; a power cut can also undo renames whose directory
    fsync had not happened. So after each kill a few block files are removed, as such a crash would,
    and the restarted tier must not even name them, though it takes the directories that did not change
    from the index file (written every 50 ms; each run pauses so that the directories settle, then
    writes into every other fan-out directory, so the others stay settled). With a 12 MiB tier, full
    after the first runs, nearly every block is written over the file of a block evicted for it."""
    rng = random.Random(5)
    directory = None
    args = ("--fs-write-through", "true", "--fs-size", fs_size, "--fs-io-threads", "4", "--fs-index-interval", "0.05")
    block = 64 * 1024
    served = 0
    lost: set[bytes] = set()
    from_index_file = 0
    for loop in range(20):
        left = list((directory / "fs").rglob("*.tmp")) if directory else []  # by the kill
        daemon = fs_daemons(*args, directory=directory)
        directory = daemon.directory
        tmp_files = [p for p in (directory / "fs").rglob("*.tmp") if p in left or not p.name.startswith("index.kvi.")]
        assert not tmp_files, tmp_files  # (an index file write of the new daemon may be under way)
        served += verify_everything_on_disk(daemon, block, lost)
        assert fs_stats(daemon).checksum_failures == 0  # a miss at most, never a torn or wrong file
        indexed = daemon.log().split("fs tier indexed")[-1]
        from_index_file += int(re.search(r"directories_from_index_file=(\d+)", indexed).group(1))
        time.sleep(RACY_SECONDS + 0.1)
        stop = threading.Event()
        writer = threading.Thread(target=store_until_killed, args=(daemon, f"kill-{loop}", block, stop, loop % 2))
        writer.start()
        time.sleep(rng.uniform(0.1, 0.5))
        daemon.stop(signal.SIGKILL)
        stop.set()
        writer.join()
        files = sorted((directory / "fs").rglob("*.kvb"))
        for path in rng.sample(files, min(3, len(files))):
            path.unlink()
            lost.add(bytes.fromhex(path.name.removesuffix(".kvb")))
    assert served > 100 and len(lost) > 20  # the loops did put blocks on disk, lose some and read back the rest
    if fs_size == "192MiB":  # (a full tier evicts from every directory: none stays unchanged)
        assert from_index_file > 16  # and restarts did trust the index file for unchanged directories


def store_until_killed(daemon: DaemonProcess, seed: str, block: int, stop: threading.Event, parity: int) -> None:
    """Store blocks as fast as possible, only blocks whose fan-out directory (first hex digit) has `parity`."""
    try:
        with KVTierClient(daemon.address) as client:
            ns = client.register(spec(block_bytes=block))
            for batch in range(1000):
                if stop.is_set():
                    return
                hashes = [h for h in chain_hashes(f"{seed}-{batch}", 32) if (h[0] >> 4) % 2 == parity]
                client.store(ns, hashes, contents(hashes, block))
    except (grpc.RpcError, ConnectionError):
        return  # the daemon was killed


def verify_everything_on_disk(daemon: DaemonProcess, block: int, lost: set[bytes]) -> int:
    """Every block the tier lists loads byte-exact or not at all; none of the `lost` ones is listed."""
    listed = daemon.admin("ListBlocks", tier="fs", page_size=10_000)
    claimed = lost & {info.hash for info in listed.blocks}  # the index (file) must not even name them
    assert not claimed, [h.hex() for h in claimed]
    with KVTierClient(daemon.address) as client:
        ns = client.register(spec(block_bytes=block))
        loaded = 0
        hashes = [info.hash for info in listed.blocks]
        for start in range(0, len(hashes), 64):
            batch = hashes[start : start + 64]
            data = client.load(ns, batch, transport="inline")
            if len(data) < len(batch):  # a block may be missing (evicted meanwhile), never wrong: one by one
                data = [client.load(ns, [h], transport="inline") for h in batch]
            for block_hash, got in zip(batch, data, strict=True):
                if len(got):
                    assert np.array_equal(got.reshape(-1), block_content(block_hash, block)), block_hash.hex()
                    loaded += 1
    return loaded


@pytest.mark.parametrize(("written_direct", "read_direct"), [("false", "false"), ("true", "true"), ("false", "true")])
def test_flipped_or_truncated_files_are_caught_and_dropped(fs_daemons, written_direct, read_direct):
    """Read with --fs-direct-io, header and bytes come in one O_DIRECT request (bytes at 4 KiB in a file
    written with it, right after the header in one written without it)."""
    daemon, ns, hashes, data = stored_on_disk(fs_daemons, "flip", 8, "--fs-direct-io", written_direct)
    daemon.stop()
    flipped, truncated, inspected = (block_file(daemon, ns.id, hashes[i]) for i in (3, 5, 7))
    with open(flipped, "r+b") as f:  # one bit of the block's bytes, deep inside the file
        f.seek(-1000, 2)
        byte = f.read(1)
        f.seek(-1000, 2)
        f.write(bytes([byte[0] ^ 0x01]))
    with open(truncated, "r+b") as f:
        f.truncate(truncated.stat().st_size - 10)
    with open(inspected, "r+b") as f:  # the last byte
        f.seek(-1, 2)
        f.write(bytes([data[7, -1] ^ 0xFF]))
    daemon = fs_daemons("--fs-direct-io", read_direct, directory=daemon.directory)
    with KVTierClient(daemon.address) as client:
        ns = client.register(spec(block_bytes=BLOCK))
        assert client.lookup(ns, hashes).hit_count == 8  # the index knows names only until a file is read
        assert np.array_equal(client.load(ns, hashes[:4]), data[:3])
        assert gone(flipped) and truncated.exists()
        assert client.lookup(ns, hashes).hit_count == 3
        assert np.array_equal(client.load(ns, hashes[4:6]), data[4:5])
        assert gone(truncated)
        with pytest.raises(grpc.RpcError) as caught:
            daemon.admin("InspectBlock", namespace=ns.id, hash=hashes[7], tier="fs")
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND and "dropped" in caught.value.details()
        assert gone(inspected)
    assert fs_stats(daemon).checksum_failures == 3
    assert "fs block file corrupt; deleted" in daemon.log()


def test_a_restart_with_a_smaller_fs_size_evicts_down_to_it(fs_daemons):
    """Restarted with --fs-size below what its directory holds, the tier drops files until it fits
    before it serves; the blocks it keeps load byte-exact."""
    daemon, ns, hashes, data = stored_on_disk(fs_daemons, "shrunk", 12)
    assert daemon.stop() == 0
    again = fs_daemons("--fs-size", "2MiB", directory=daemon.directory)  # 7 blocks of 256 KiB + 4 KiB
    assert fs_stats(again).blocks == 7
    files = list((again.directory / "fs" / ns.id).rglob("*.kvb"))
    assert len(files) == 7 and sum(f.stat().st_size for f in files) <= 2 << 20
    kept = [b.hash for b in again.admin("ListBlocks", namespace=ns.id, tier="fs").blocks]
    assert len(kept) == 7
    with KVTierClient(again.address) as client:
        client.register(spec(block_bytes=BLOCK))
        for block_hash in kept:
            index = hashes.index(block_hash)
            assert np.array_equal(client.load(ns, [block_hash]), data[index : index + 1])


def test_eviction_keeps_the_tier_under_its_size(fs_daemons):
    for policy in ("lru", "arc"):
        daemon = fs_daemons("--fs-size", "4MiB", "--fs-eviction", policy)
        with KVTierClient(daemon.address) as client:
            ns = client.register(spec(block_bytes=BLOCK))
            for start in range(0, 64, 8):
                hashes = chain_hashes(f"size-{start}", 8)
                client.store(ns, hashes, contents(hashes, BLOCK))
                deadline = time.monotonic() + 10
                while (stats := fs_stats(daemon)).stored_blocks < max(0, start - 8):  # victims of this store
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
                files = list((daemon.directory / "fs" / ns.id).rglob("*.kvb"))
                assert sum(f.stat().st_size for f in files) <= 4 << 20 and stats.bytes <= 4 << 20
            files = list((daemon.directory / "fs" / ns.id).rglob("*.kvb"))
            assert stats.stored_blocks == 48 and stats.evictions == 48 - 15  # the pool's 48 victims were demoted
            assert stats.blocks == 15 == len(files)  # 15 * (256 KiB + 4 KiB header) fit in 4 MiB
            assert sum(f.stat().st_size for f in files) <= 4 << 20
            assert stats.capacity_bytes == 4 << 20


@pytest.mark.parametrize("direct_io", ["false", "true"])
def test_a_full_tier_writes_new_blocks_over_the_files_of_the_blocks_it_evicts(fs_daemons, direct_io):
    """The file of a block the tier evicts is renamed, rewritten in place for the next block and renamed
    to that block's name (its space already allocated): a hard link taken to an old file sees another
    block's bytes afterwards. Then blocks of half the size go over the larger files. Every file left
    reads back intact, at its exact size, with the block the pool stored."""
    daemon = fs_daemons("--fs-size", "4MiB", "--fs-direct-io", direct_io)
    links = daemon.directory / "links"
    links.mkdir()
    with KVTierClient(daemon.address) as client:
        ns = client.register(spec(block_bytes=BLOCK))
        stored = {}
        for round_index in range(8):  # 8 blocks a round: from the third on, the pool's victims go to disk
            hashes = chain_hashes(f"recycle-{round_index}", 8)
            client.store(ns, hashes, contents(hashes, BLOCK))
            stored.update(dict.fromkeys(hashes, round_index))
            deadline = time.monotonic() + 10
            while fs_stats(daemon).stored_blocks < max(0, 8 * round_index - 8):  # this round's victims written
                assert time.monotonic() < deadline
                time.sleep(0.01)
            if round_index == 3:  # the tier holds 15 blocks now (16 demoted, one evicted)
                taken = {}
                for path in (daemon.directory / "fs" / ns.id).rglob("*.kvb"):
                    (links / path.name).hardlink_to(path)
                    taken[path.name] = path.read_bytes()
        assert any((links / name).read_bytes() != old for name, old in taken.items())  # rewritten in place
        assert len(list((daemon.directory / "fs" / ns.id).rglob("*.kvb"))) == fs_stats(daemon).blocks == 15
        small = client.register(spec(block_bytes=BLOCK // 2, model_id="smaller"))
        hashes = chain_hashes("recycle-small", 96)
        for start in range(0, 96, 16):  # the pool's large blocks go to disk first, then small ones
            client.store(small, hashes[start : start + 16], contents(hashes[start : start + 16], BLOCK // 2))
            settled(daemon)
    checked = 0
    for namespace, length in ((ns, BLOCK), (small, BLOCK // 2)):
        for path in (daemon.directory / "fs" / namespace.id).rglob("*.kvb"):
            block_hash = bytes.fromhex(path.name.removesuffix(".kvb"))
            data = fs_format.aligned_empty(length)
            header = fs_format.read_block(path, namespace.id, block_hash, length, [memoryview(data)], direct=False)
            assert path.stat().st_size == header.data_offset + length  # a larger file's tail cut off
            assert np.array_equal(data, block_content(block_hash, length))
            assert block_hash in stored or block_hash in hashes
            checked += 1
    assert checked == fs_stats(daemon).blocks and len(list((daemon.directory / "fs" / small.id).rglob("*.kvb"))) > 8


def settled(daemon: DaemonProcess, timeout: float = 30.0) -> None:
    """Wait until every block copied out of the pool for the disk is written (or failed): demotions done."""
    url = f"http://127.0.0.1:{daemon.admin('GetInfo').metrics_port}/metrics"
    deadline = time.monotonic() + timeout
    while "kvtierd_fs_queue_bytes 0.0" not in urllib.request.urlopen(url).read().decode():
        assert time.monotonic() < deadline, "writes still queued"
        time.sleep(0.01)


def _can_mount_tmpfs() -> bool:
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=1m tmpfs /mnt"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.skipif(not _can_mount_tmpfs(), reason="needs unprivileged mount namespaces (unshare -rm) for a tiny tmpfs")
def test_disk_full_pauses_stores_and_the_ram_tier_keeps_serving(fs_daemons):
    """A real full filesystem: the daemon runs in its own mount namespace where --fs-path is a 2 MiB
    tmpfs, so writes fail with ENOSPC from the kernel (the tier's own --fs-size is far larger)."""
    directory = new_daemon_dir()
    mount = ["unshare", "-rm", "sh", "-c", 'mount -t tmpfs -o size=2m,mode=0700 tmpfs "$0" && exec "$@"', str(directory / "fs")]
    (directory / "fs").mkdir()
    daemon = fs_daemons("--fs-write-through", "true", directory=directory, prefix=tuple(mount))
    with KVTierClient(daemon.address) as client:
        ns = client.register(spec(block_bytes=BLOCK))
        hashes = chain_hashes("full", 12)
        data = contents(hashes, BLOCK)
        assert client.store(ns, hashes, data) == 12
        deadline = time.monotonic() + 10
        while not ((stats := fs_stats(daemon)).stores_paused and stats.blocks):  # (indexed once committed)
            assert time.monotonic() < deadline, "the full disk was not noticed"
            time.sleep(0.02)
        assert stats.io_errors >= 1 and 0 < stats.blocks < 12
        assert "stores paused" in daemon.log() and "No space left on device" in daemon.log()
        more = chain_hashes("full-more", 4)  # the RAM tier goes on storing and serving
        assert client.store(ns, more, contents(more, BLOCK)) == 4
        assert np.array_equal(client.load(ns, hashes), data)
        assert np.array_equal(client.load(ns, more), contents(more, BLOCK))
        settled(daemon)
        on_disk = fs_stats(daemon).blocks
        filler = chain_hashes("full-filler", 16)  # evict everything: disk blocks still load
        client.store(ns, filler, contents(filler, BLOCK))
        disk_hashes = [b.hash for b in daemon.admin("ListBlocks", namespace=ns.id, tier="fs").blocks]
        assert len(disk_hashes) == on_disk
        for h in disk_hashes:
            assert np.array_equal(client.load(ns, [h])[0], block_content(h, BLOCK))
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{daemon.admin('GetInfo').metrics_port}/metrics").read().decode()
    assert "kvtierd_fs_stores_paused 1.0" in metrics
    assert daemon.process.poll() is None


@pytest.mark.skipif(not _can_mount_tmpfs(), reason="needs unprivileged mount namespaces (unshare -rm) for a read-only mount")
def test_a_read_only_disk_at_start_serves_its_blocks_and_the_ram_tier(fs_daemons):
    """The tier's filesystem is read-only when the daemon starts (ext4 remounts read-only after I/O
    errors), with leftovers of interrupted writes it cannot remove: the daemon starts, serves the
    blocks on disk and the RAM tier, and pauses stores to disk with a logged error."""
    hashes = chain_hashes("read-only", 8)
    daemon, ns_id = written_then_stopped(fs_daemons, hashes)
    fs = daemon.directory / "fs"
    strays = [fs / "index.kvi.1.tmp", fs / ns_id / "namespace.pb.1.tmp", block_file(daemon, ns_id, hashes[0]).with_suffix(".tmp")]
    for stray in strays:
        stray.write_bytes(b"interrupted")
    read_only = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"'
    mount = ("unshare", "-rm", "sh", "-c", read_only, str(fs))
    daemon = fs_daemons("--fs-write-through", "true", "--fs-direct-io", "true", directory=daemon.directory, prefix=mount)
    with KVTierClient(daemon.address) as client:
        ns = client.register(spec(block_bytes=BLOCK))
        assert fs_stats(daemon).blocks == 8 and all(stray.exists() for stray in strays)
        assert np.array_equal(client.load(ns, hashes), contents(hashes, BLOCK))  # read from the read-only disk
        more = chain_hashes("read-only-more", 16)  # their writes fail
        assert client.store(ns, more, contents(more, BLOCK)) == 16
        deadline = time.monotonic() + 10
        while not fs_stats(daemon).stores_paused:
            assert time.monotonic() < deadline, "the read-only disk was not noticed"
            time.sleep(0.02)
        assert np.array_equal(client.load(ns, more), contents(more, BLOCK))
    assert "Read-only file system" in daemon.log() and "stores paused" in daemon.log()
    assert daemon.process.poll() is None


def test_admin_and_metrics_across_tiers(fs_daemons):
    daemon = fs_daemons("--fs-write-through", "true")
    with KVTierClient(daemon.address) as client:
        ns = client.register(spec(block_bytes=BLOCK))
        hashes = chain_hashes("admin", 20)
        for start in (0, 10):  # written-through blocks stay pinned until on disk: two batches fit the pool
            client.store(ns, hashes[start : start + 10], contents(hashes[start : start + 10], BLOCK))
            wait_on_disk(daemon, start + 10)
        listed = daemon.admin("ListBlocks", namespace=ns.id, page_size=100)
        tiers = [b.tier for b in listed.blocks]
        assert listed.total == 36 and tiers.count("ram") == 16 and tiers.count("fs") == 20
        only_fs = daemon.admin("ListBlocks", namespace=ns.id, tier="fs", page_size=5)
        assert only_fs.total == 20 and len(only_fs.blocks) == 5 and {b.tier for b in only_fs.blocks} == {"fs"}
        in_both = hashes[-1]
        assert daemon.admin("InspectBlock", namespace=ns.id, hash=in_both).block.tier == "ram"
        on_disk = daemon.admin("InspectBlock", namespace=ns.id, hash=in_both, tier="fs")
        assert on_disk.block.tier == "fs" and on_disk.checksum == on_disk.stored_checksum and not on_disk.page_ids
        # which blocks the pool evicted depends on the order the disk writes finished in
        in_ram = {b.hash for b in listed.blocks if b.tier == "ram"}
        disk_only = next(h for h in hashes if h not in in_ram)
        only_disk = daemon.admin("InspectBlock", namespace=ns.id, hash=disk_only)
        assert only_disk.block.tier == "fs"
        assert daemon.admin("DeleteBlocks", namespace=ns.id, hashes=disk_only + in_both).deleted_count == 2
        assert gone(block_file(daemon, ns.id, disk_only)) and gone(block_file(daemon, ns.id, in_both))
        assert client.lookup(ns, hashes).hit_count == hashes.index(disk_only)  # the prefix ends where a block went
        for tier, code in (("tape", grpc.StatusCode.INVALID_ARGUMENT),):
            with pytest.raises(grpc.RpcError) as caught:
                daemon.admin("ListBlocks", tier=tier)
            assert caught.value.code() == code
        with pytest.raises(grpc.RpcError) as caught:
            daemon.admin("InspectBlock", namespace=ns.id, hash=b"short", tier="fs")
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        stats_text = ctl(daemon, "stats").stdout
        assert "fs tier: 0 I/O errors, stores on" in stats_text
        assert any(line.split()[:3] == ["(all)", "fs", "18"] for line in stats_text.splitlines())
        assert "fs" in ctl(daemon, "blocks", "--tier", "fs").stdout
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{daemon.admin('GetInfo').metrics_port}/metrics").read().decode()
        assert 'kvtierd_tier_blocks{tier="fs"} 18.0' in metrics
        assert 'kvtierd_tier_capacity_bytes{tier="fs"} 6.7108864e+07' in metrics
        assert 'kvtierd_stored_blocks_total{tier="fs"} 20.0' in metrics
        assert daemon.admin("Clear", all=True).deleted_count == 18
        assert all(gone(block_file(daemon, ns.id, h)) for h in hashes)
        assert fs_stats(daemon).blocks == 0


def test_blocks_on_disk_of_a_retired_namespace_keep_their_size_and_bytes(fs_daemons):
    daemon = fs_daemons("--max-namespaces", "1", "--fs-write-through", "true")
    with KVTierClient(daemon.address) as client:
        ns = client.register(spec(model_id="retired", block_bytes=BLOCK))
        hashes = chain_hashes("retired", 4)
        client.store(ns, hashes, contents(hashes, BLOCK))
        wait_on_disk(daemon, 4)
    with KVTierClient(daemon.address) as client:
        client.register(spec(model_id="newer", block_bytes=BLOCK))  # (retires the first)
    assert "namespace retired" in daemon.log()
    assert fs_stats(daemon).bytes == 4 * BLOCK  # (blocks x block_bytes, as before the retirement)
    listed = daemon.admin("ListBlocks", tier="fs").blocks
    assert sorted(b.hash for b in listed) == sorted(hashes) and {b.size_bytes for b in listed} == {BLOCK}


def test_inspecting_a_block_on_disk_after_a_restart_reads_its_creation_time(fs_daemons):
    daemon, ns, hashes, _ = stored_on_disk(fs_daemons, "created", 2)
    created = daemon.admin("InspectBlock", namespace=ns.id, hash=hashes[0], tier="fs").block.created_at
    assert created > 0
    daemon.stop()
    daemon = fs_daemons(directory=daemon.directory)
    assert daemon.admin("ListBlocks", tier="fs").blocks[0].created_at == 0  # (unknown until first read)
    for _ in range(2):
        assert daemon.admin("InspectBlock", namespace=ns.id, hash=hashes[0], tier="fs").block.created_at == created


def test_fs_options_are_validated():
    with pytest.raises(SystemExit, match="fs_size must be given"):
        load_config(["--fs-path", "/tmp/somewhere"], environ={})
    with pytest.raises(SystemExit, match="fs_eviction"):
        load_config(["--fs-path", "/tmp/x", "--fs-size", "1GiB", "--fs-eviction", "fifo"], environ={})
    config = load_config(["--fs-path", "/tmp/x"], environ={"KVTIERD_FS_SIZE": "2GiB", "KVTIERD_FS_DIRECT_IO": "yes"})
    assert (config.fs_size, config.fs_direct_io, config.fs_io_threads) == (2 << 30, True, 8)


def test_tier_off_refuses_fs_admin_requests(daemon):
    with pytest.raises(grpc.RpcError) as caught:
        daemon.admin("ListBlocks", tier="fs")
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert [t.tier for t in daemon.admin("GetStats").tiers] == ["ram"]


@pytest.mark.parametrize("field", ["sum", "created", "xxh3"])
def test_a_changed_header_field_is_caught(tmp_path, field):
    """The header's fields are covered by a checksum of their own: a bit flipped in the kvtier checksum
    (handed to every loader), the created time or the bytes' xxh3 makes the file bad, not a block
    that fails every load later."""
    data = fs_format.aligned_empty(BLOCK)
    data[:] = np.frombuffer(block_content(b"h" * 32, BLOCK).tobytes(), dtype=np.uint8)
    path = tmp_path / "block.kvb"
    fs_format.write_block_file(path, "ns", b"h" * 32, BLOCK, 0x1234567890ABCDEF, 1.5e9, [memoryview(data)], direct=False)
    raw = bytearray(path.read_bytes())
    size = int.from_bytes(raw[4:8], "little")
    fields = msgpack.unpackb(bytes(raw[8 : 8 + size]))
    fields[field] = fields[field] + 1.0 if field == "created" else fields[field] ^ 1
    header = msgpack.packb(fields)
    assert len(header) == size  # the same layout, one field changed
    raw[8 : 8 + size] = header
    path.write_bytes(bytes(raw))
    with pytest.raises(fs_format.BadBlock, match="header checksum mismatch"):
        fs_format.read_block(path, "ns", b"h" * 32, BLOCK, [memoryview(fs_format.aligned_empty(BLOCK))], direct=False)


@pytest.mark.parametrize("reused", [False, True], ids=["new-file", "over-an-evicted-blocks-file"])
def test_a_block_file_is_fsynced_under_its_temporary_name_before_it_is_renamed(tmp_path, monkeypatch, reused):
    """The crash safety of a block file: its bytes are durable before its name appears (else a power
    cut could leave the name over a file whose bytes never reached the disk); a reused file of an
    evicted block first loses its old name for good (its directory fsync'd) before it is overwritten."""
    events: list[tuple[str, ...]] = []
    real_fsync, real_rename, real_fsync_directory = os.fsync, os.rename, fs_format.fsync_directory
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}"))) or real_fsync(fd))
    monkeypatch.setattr(os, "rename", lambda src, dst: events.append(("rename", str(src), str(dst))) or real_rename(src, dst))
    monkeypatch.setattr(fs_format, "fsync_directory", lambda d: events.append(("fsync_dir", str(d))) or real_fsync_directory(d))
    data = fs_format.aligned_empty(BLOCK)
    data[:] = np.frombuffer(block_content(b"f" * 32, BLOCK).tobytes(), dtype=np.uint8)
    old = tmp_path / "old.kvb"
    old.write_bytes(b"an evicted block's file" * 1000)
    path = tmp_path / "block.kvb"
    events.clear()
    fs_format.write_block_file(
        path, "ns", b"f" * 32, BLOCK, 7, 1.5e9, [memoryview(data)], direct=False, reuse=old if reused else None
    )
    renames = [e for e in events if e[0] == "rename"]
    temporary = renames[-1][1]
    assert renames[-1][2] == str(path) and temporary != str(path)
    assert events.index(("fsync", temporary)) < events.index(renames[-1])  # durable, then named
    if reused:
        assert renames[0] == ("rename", str(old), temporary) and not old.exists()
        assert events.index(renames[0]) < events.index(("fsync_dir", str(tmp_path))) < events.index(("fsync", temporary))
    header = fs_format.read_block(path, "ns", b"f" * 32, BLOCK, [memoryview(fs_format.aligned_empty(BLOCK))], direct=False)
    assert header.checksum == 7


@pytest.mark.parametrize("call", ["Clear", "DeleteBlocks"])
def test_blocks_deleted_before_a_crash_stay_deleted(fs_daemons, call):
    """Clear and DeleteBlocks answer once the blocks' files are removed: a crash (SIGKILL) right after
    the answer cannot bring them back at the next start. (They answered while the removals still
    waited for an I/O thread, and most of several thousand cleared blocks were indexed and served
    again after the crash.)"""
    hashes = chain_hashes(f"deleted-{call}", 4000)
    daemon, ns_id = written_then_stopped(fs_daemons, hashes[:1], SMALL, "--fs-size", "1GiB")  # (its directory, spec file)
    root, data = daemon.directory / "fs", fs_format.aligned_empty(SMALL)
    for h in hashes[1:]:  # blocks of a namespace, as a long-running daemon would have written them
        fs_format.write_block_file(
            fs_format.block_path(root, ns_id, h), ns_id, h, SMALL, 0, time.time(), [memoryview(data)], False, durable=False
        )
    again = fs_daemons("--fs-size", "1GiB", directory=daemon.directory)
    assert fs_stats(again).blocks == len(hashes)
    fields = {"hashes": b"".join(hashes)} if call == "DeleteBlocks" else {}
    assert again.admin(call, namespace=ns_id, **fields).deleted_count == len(hashes)
    again.process.send_signal(signal.SIGKILL)
    again.process.wait()
    third = fs_daemons("--fs-size", "1GiB", directory=daemon.directory)
    assert fs_stats(third).blocks == 0


def test_a_fifo_named_like_a_block_is_a_miss_removed_and_the_daemon_still_stops(fs_daemons):
    """A file of the wrong kind under a block's name (a FIFO put there by hand) is found by its name
    at start; its first read must not wait for a writer that never comes (the promotion's pages held
    for good, and an I/O thread that kept the daemon from exiting): it is a bad block, a miss, and
    removed."""
    hashes = chain_hashes("fifo", 2)
    daemon, ns_id = written_then_stopped(fs_daemons, hashes)
    path = block_file(daemon, ns_id, hashes[0])
    path.unlink()
    os.mkfifo(path)
    again = fs_daemons(directory=daemon.directory)
    with KVTierClient(again.address, timeout=10) as client:
        ns = client.register(spec(block_bytes=BLOCK))
        assert client.lookup(ns, hashes, pin=True).hit_count == 0
    assert not path.exists() and fs_stats(again).blocks == 1
    again.process.send_signal(signal.SIGTERM)
    assert again.process.wait(20) == 0


def test_a_block_file_is_written_anew_over_an_evicted_name_that_is_no_longer_a_file(tmp_path):
    """The file of an evicted block reused for a new one turned out to be a FIFO or a symbolic link: a
    new file is written (opening the FIFO to write over it would wait for a reader for good; the
    link would have the daemon write over whatever it points to), and reading either under a
    block's name is a BadBlock at once."""
    data = fs_format.aligned_empty(BLOCK)
    data[:] = np.frombuffer(block_content(b"f" * 32, BLOCK).tobytes(), dtype=np.uint8)
    old, path = tmp_path / "old.kvb", tmp_path / "block.kvb"
    os.mkfifo(old)
    fs_format.write_block_file(path, "ns", b"f" * 32, BLOCK, 7, 1.5e9, [memoryview(data)], direct=False, reuse=old)
    assert not old.exists() and path.is_file()
    assert fs_format.read_block(path, "ns", b"f" * 32, BLOCK, [memoryview(fs_format.aligned_empty(BLOCK))], False).checksum == 7
    os.mkfifo(tmp_path / "fifo.kvb")
    with pytest.raises(fs_format.BadBlock, match="not a regular file"):
        fs_format.read_block(tmp_path / "fifo.kvb", "ns", b"f" * 32, BLOCK, [memoryview(data)], direct=False)
    victim = tmp_path / "victim.txt"  # a link where an evicted block's file was: not followed, either way
    victim.write_text("keep me")
    (tmp_path / "link.kvb").symlink_to(victim)
    link = tmp_path / "link.kvb"
    fs_format.write_block_file(path, "ns", b"f" * 32, BLOCK, 7, 1.5e9, [memoryview(data)], direct=False, reuse=link)
    (tmp_path / "link.kvb").symlink_to(victim)
    with pytest.raises(fs_format.BadBlock, match="not a regular file"):
        fs_format.read_block(tmp_path / "link.kvb", "ns", b"f" * 32, BLOCK, [memoryview(data)], direct=False)
    assert victim.read_text() == "keep me" and path.is_file()


def test_the_index_file_records_no_directory_changed_within_a_coarse_timestamps_tick(tmp_path):
    """On filesystems with 1-second (or 2-second) mtimes, a directory changed in the same tick after
    its mtime was taken keeps that mtime: it must not be recorded, or a restart after a crash would
    take its names from the index file and hide the later file for good."""
    from kvtierd.fs_snapshot import directory_mtimes  # noqa: PLC0415

    now = time.time()
    for name, age in (("a", 0.4), ("b", 1.5), ("c", 2.5)):
        (tmp_path / "ns" / name).mkdir(parents=True)
        os.utime(tmp_path / "ns" / name, (now - age, now - age))
    assert set(directory_mtimes(tmp_path, ["ns"], ["a", "b", "c"])["ns"]) == {"c"}
