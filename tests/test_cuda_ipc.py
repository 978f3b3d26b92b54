"""TRANSPORT_CUDA_IPC end to end: fake GPU engines (tests/fake_engine.py, separate processes, torch
only) store and load through a real daemon that copies with CUDA IPC. The GPU tests run on the
device machine; without CUDA they skip, and the refusal test checks the fallback path here."""

from __future__ import annotations

import concurrent.futures
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from blocks import spec
from daemon import DaemonProcess, new_daemon_dir, remove_daemon_dir

from kvtier.client import KVTierClient
from kvtier.pool_view import PoolMapping, decode_page_ids
from kvtier.v1 import kvtier_pb2 as pb

torch = pytest.importorskip("torch")
from fake_engine import (  # noqa: E402 (needs torch)
    Geometry,
    allocate_kv_cache,
    block_hashes,
    gpu,
    namespace_spec,
    seeded_blocks,
)

HERE = Path(__file__).parent


GEOMETRY = {"layers": 4, "heads": 8, "block_size": 16, "head_size": 128, "num_blocks": 64}  # 256 KiB blocks


def test_daemon_without_cuda_refuses_cuda_ipc_and_keeps_the_namespace(start_daemon):
    daemon = start_daemon("--pool-size", "16MiB", "--cuda-register", "false")
    cache = well_formed_cache()
    with KVTierClient(daemon.address, engine_name="gpu-engine") as client:
        ns = client.register(spec(block_bytes=4096), cache)
        assert not ns.cuda_registration
        no_cuda = ("cannot serve cuda_ipc", "has no CUDA device", "pool is not registered with CUDA")
        assert any(reason in ns.cuda_refused for reason in no_cuda), ns.cuda_refused
        assert client.lookup(ns, [b"h" * 32]).hit_count == 0  # the namespace works (shm transport)
        cache.runs[0].block_stride = 1 << 20  # block 3 would end beyond the allocation
        malformed = client.register(spec(block_bytes=4096), cache)
        assert not malformed.cuda_registration and "beyond its allocation" in malformed.cuda_refused
        assert malformed.id == ns.id
    assert "cuda_ipc refused" in daemon.log()


def _can_run(*command: str) -> bool:
    """The command exists and succeeds here (checks what a test's namespaces need)."""
    try:
        return subprocess.run(command, capture_output=True).returncode == 0
    except OSError:
        return False


def _can_unshare_time() -> bool:
    return _can_run("unshare", "--user", "--map-root-user", "--time", "--monotonic", "100", "true")


@pytest.mark.skipif(not _can_unshare_time(), reason="needs unprivileged time namespaces (unshare --user --time)")
@pytest.mark.parametrize("offset", ["-100", "100"])  # the engine's clock 100 s ahead of the daemon's, or behind
def test_cuda_ipc_is_refused_to_an_engine_whose_clock_is_not_the_daemons(start_daemon, offset):
    """cuda_ipc deadlines are in the engine's CLOCK_MONOTONIC: a daemon in another time namespace
    would read them as other moments (copies after the engine stopped waiting, or every copy
    refused), so it refuses the cache (the engine uses shm), checked before anything is opened."""
    in_time_namespace = ("unshare", "--user", "--map-root-user", "--time", "--monotonic", offset)
    daemon = start_daemon("--pool-size", "16MiB", prefix=in_time_namespace)
    with KVTierClient(daemon.address, engine_name="gpu-engine") as client:
        ns = client.register(spec(block_bytes=4096), well_formed_cache())
        assert not ns.cuda_registration and "CLOCK_MONOTONIC" in ns.cuda_refused, ns.cuda_refused
        assert f"{-float(offset):+.1f} s from this daemon's" in ns.cuda_refused
        assert client.lookup(ns, [b"h" * 32]).hit_count == 0  # the namespace works (shm transport)


def _can_unshare_pid() -> bool:
    return _can_run("unshare", "--pid", "--fork", "--mount-proc", "true")


IN_PID_NAMESPACE = ("unshare", "--pid", "--fork", "--kill-child=SIGTERM", "--mount-proc")  # (of its own)


@gpu
@pytest.mark.skipif(not _can_unshare_pid(), reason="needs PID namespaces (unshare --pid: root)")
@pytest.mark.parametrize("daemon_namespace", ["the host's", "a sibling of the engine's"])
def test_cuda_ipc_needs_pid_namespaces_one_inside_the_other(daemon_namespace):
    """The engine in a PID namespace of its own (a container or pod). CUDA opens its IPC handles for a
    daemon in the host's PID namespace, which the engine's is inside (Kubernetes: hostPID for the
    daemon), but not for one in a sibling namespace (each pod or container its own): CUDA answers
    `invalid device context`, the daemon refuses cuda_ipc with the reason, and the engine copies
    through shared memory itself. Byte-exact either way."""
    sibling = daemon_namespace == "a sibling of the engine's"
    daemon = DaemonProcess(new_daemon_dir(), ["--pool-size", "128MiB"], prefix=list(IN_PID_NAMESPACE) if sibling else [])
    steps = [
        {"fill": list(range(16)), "seed": 4},
        {"store": list(range(16)), "seed": 4},
        {"load": list(range(32, 48)), "seed": 4},
        {"check": list(range(32, 48)), "seed": 4},
    ]
    try:
        daemon.start()
        out = results(engine(daemon.address, steps, prefix=IN_PID_NAMESPACE))
        assert out[1]["stored_blocks"] == 16 and out[2]["loaded"] and out[3]["matches"]
        assert out[1]["cuda_ipc"] == out[2]["cuda_ipc"] == (not sibling)
        refused = [line for line in daemon.log().splitlines() if "cuda_ipc refused" in line]
        assert len(refused) == sibling, refused
        if sibling:
            assert "invalid device context" in refused[0] and "in one PID namespace or one inside the other" in refused[0]
    finally:
        daemon.stop(signal.SIGKILL if sibling else signal.SIGTERM)  # (unshare ignores SIGTERM; dying, it sends it on)
        deadline = time.monotonic() + 15
        while daemon.socket.exists() and time.monotonic() < deadline:  # (the daemon ends after unshare)
            time.sleep(0.05)
        remove_daemon_dir(daemon.directory)


def test_cuda_ipc_is_refused_without_the_engines_clock(start_daemon):
    daemon = start_daemon("--pool-size", "16MiB")
    with KVTierClient(daemon.address, engine_name="gpu-engine") as client:
        request = pb.RegisterRequest(session_id=client.state.session_id, spec=spec(block_bytes=4096), cuda_kv=well_formed_cache())
        response = client.data_socket.call("Register", request)
        assert not response.cuda_registration and "needs RegisterRequest.monotonic_ns" in response.cuda_refused


def well_formed_cache() -> pb.CudaKVCache:
    """What an engine with 4 blocks of 4 KiB in one 1 MiB allocation sends (the handles made up)."""
    cache = pb.CudaKVCache(
        device_uuid="GPU-0",
        allocations=[
            pb.CudaAllocation(
                ipc_handle=b"x" * 64, size_bytes=1 << 20, ref_counter_handle=b"/torch_1234_5678_0", ref_counter_offset=9
            )
        ],
        num_blocks=4,
        ready_events=[b"e" * 64],
    )
    cache.runs.add(allocation=0, offset=0, block_stride=4096, size_bytes=4096)
    return cache


MALFORMED = {
    "no ready event": (lambda c: c.ClearField("ready_events"), "ring of 1 to 256 ready events"),
    "a ring of 257 ready events": (lambda c: c.ready_events.extend([b"e" * 64] * 256), "ring of 1 to 256 ready events"),
    "ref counter slot outside its file": (lambda c: setattr(c.allocations[0], "ref_counter_offset", 1 << 40), "ref_counter"),
    "runs not adding up to the block": (lambda c: setattr(c.runs[0], "size_bytes", 2048), "bytes per block"),
    "a run's size in the exabytes": (lambda c: setattr(c.runs[0], "block_stride", 1 << 62), "must be below"),
    "an allocation in the exabytes": (lambda c: setattr(c.allocations[0], "size_bytes", 1 << 63), "must be below"),
    "a run beyond its allocation": (lambda c: setattr(c.runs[0], "block_stride", 1 << 20), "beyond its allocation"),
    "a run in a missing allocation": (lambda c: setattr(c.runs[0], "allocation", 1), "names allocation"),
    # an allocation 4 bytes off: every word the kernel moves misaligned, a fault for every engine on the GPU
    "a misaligned allocation": (lambda c: setattr(c.allocations[0], "offset", 4), "multiples of 8"),
    "a short IPC handle": (lambda c: setattr(c.allocations[0], "ipc_handle", b"x"), "64 bytes"),
    "a short event handle": (lambda c: setattr(c.allocations[0], "event_handle", b"e"), "64 bytes"),
    # another shm file (the pool's, say) as the ref counter, which torch would change and unlink
    "a ref counter that is not torch's": (
        lambda c: setattr(c.allocations[0], "ref_counter_handle", b"/kvtierd-x.pool"),
        "torch ref",
    ),
    "overlapping blocks": (lambda c: setattr(c.runs[0], "block_stride", 2048), "overlap"),
    # each block's second run is the next block's first (two blocks sharing memory)
    "runs of two blocks in one place": (lambda c: two_runs(c, (0, 4096), (4096, 4096)), "overlap"),
    "one run twice": (lambda c: two_runs(c, (0, 4096), (0, 4096)), "overlap"),
    "runs of other strides crossing": (lambda c: two_runs(c, (0, 4096), (2048, 2048)), "overlap"),
    # the same memory (one IPC handle) twice: the second allocation's offset leads into the first's blocks
    "an allocation inside another": (lambda c: two_runs(c, (0, 4096), (0, 4096), second_allocation_at=8192), "overlap"),
    "too many runs": (
        lambda c: [c.runs.add(allocation=0, offset=8 * i, block_stride=4096, size_bytes=8) for i in range(1025)],
        "at most 1024",
    ),
    # each is checked, then opened through CUDA IPC, on the event loop (450,000 held it for 0.4 s unopened)
    "too many allocations": (lambda c: [c.allocations.add().CopyFrom(c.allocations[0]) for _ in range(1024)], "at most 1024"),
}


def two_runs(cache: pb.CudaKVCache, first: tuple, second: tuple, second_allocation_at: int | None = None) -> None:
    """The cache's block as two runs of 2 KiB, (offset, block stride) each; the second in a second
    allocation of the same memory (one IPC handle) at `second_allocation_at`, if given."""
    del cache.runs[:]
    cache.runs.add(allocation=0, offset=first[0], block_stride=first[1], size_bytes=2048)
    if second_allocation_at is not None:
        cache.allocations.add().CopyFrom(cache.allocations[0])
        cache.allocations[1].offset = second_allocation_at
    cache.runs.add(allocation=len(cache.allocations) - 1, offset=second[0], block_stride=second[1], size_bytes=2048)


@pytest.mark.parametrize("case", MALFORMED)
def test_a_malformed_cuda_kv_is_refused_before_any_cuda_call(start_daemon, case):
    """Refused (the namespace still works over shm) with the reason, checked before the daemon's own
    capabilities and before torch opens anything: no number an engine sends reaches the driver or
    the kernel unchecked."""
    daemon = start_daemon("--pool-size", "16MiB", "--cuda-register", "false")
    cache = well_formed_cache()
    spoil, reason = MALFORMED[case]
    spoil(cache)
    with KVTierClient(daemon.address) as client:
        ns = client.register(spec(block_bytes=4096), cache)
        assert not ns.cuda_registration and reason in ns.cuda_refused, ns.cuda_refused
        assert client.lookup(ns, [b"h" * 32]).hit_count == 0
    assert daemon.process.poll() is None


@pytest.mark.parametrize(
    "runs",
    [
        {"first": (0, 4096), "second": (2048, 4096)},  # K and V of a block side by side
        {"first": (0, 2048), "second": (8192, 2048)},  # all blocks' K, then all blocks' V
        {"first": (0, 2048), "second": (0, 2048), "second_allocation_at": 8192},  # V in a second view of the memory
    ],
)
def test_runs_that_share_no_byte_pass_the_checks(start_daemon, runs):
    """Layouts whose runs interleave or follow each other pass the overlap check (they are refused
    further on only for this daemon's pool not being registered with CUDA)."""
    daemon = start_daemon("--pool-size", "16MiB", "--cuda-register", "false")
    cache = well_formed_cache()
    two_runs(cache, **runs)
    with KVTierClient(daemon.address) as client:
        ns = client.register(spec(block_bytes=4096), cache)
        assert not ns.cuda_registration and "not registered with CUDA" in ns.cuda_refused, ns.cuda_refused


@pytest.mark.parametrize(
    "transport,refusal",
    [
        (pb.TRANSPORT_CUDA_IPC, "no such registration"),
        (pb.TRANSPORT_CUDA_IPC, "no such namespace"),
        (pb.TRANSPORT_INLINE, "no such namespace"),
    ],
)
def test_a_load_refused_before_its_copy_releases_the_lease_it_names(start_daemon, transport, refusal):
    """A cuda_ipc or inline Load releases the lease it names whether it succeeds or fails: refused
    before any copy (no such registration, say), its blocks are not left pinned until the lease's TTL."""
    daemon = start_daemon("--pool-size", "16MiB", "--cuda-register", "false")
    with KVTierClient(daemon.address) as client:
        ns = client.register(spec(block_bytes=4096))
        hashes = [bytes([i]) * 32 for i in range(4)]
        assert client.store(ns, hashes, np.zeros((4, 4096), dtype=np.uint8)) == 4
        lease = client.lookup(ns, hashes, pin=True).lease_id
        assert daemon.admin("GetStats").pinned_blocks == 4
        request = pb.LoadRequest(
            session_id=client.state.session_id,
            namespace="no-such-namespace" if refusal == "no such namespace" else ns.id,
            lease_id=lease,
            transport=transport,
            cuda_ipc=pb.CudaIpcTarget(registration_id="no-such-registration", device_block_ids=[0, 1, 2, 3]),
        )
        with pytest.raises(grpc.RpcError) as refused:
            client.data_socket.call("Load", request)
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND
        assert daemon.admin("GetStats").pinned_blocks == 0
        with pytest.raises(grpc.RpcError) as released:
            client.release(lease)
        assert released.value.code() == grpc.StatusCode.NOT_FOUND


def test_a_registration_serves_only_its_own_namespace():
    """The kernel reads a block's pool pages with the page count of the namespace the registration was
    made for: a Load or Reserve naming another namespace (another block size) is refused."""
    from kvtierd.errors import InvalidArgument
    from kvtierd.gpu_transfers import CudaRegistration, GpuTransfers

    transfers = GpuTransfers(pool_address=0, page_size=4096, pool_registered=True)
    transfers._registrations["reg"] = CudaRegistration("reg", "session", "ns-a", 0, [], None, 4, [])
    assert transfers.registration("session", "reg", "ns-a").namespace_id == "ns-a"
    with pytest.raises(InvalidArgument, match="for namespace ns-a, not ns-b"):
        transfers.registration("session", "reg", "ns-b")


def engine(  # noqa: PLR0913
    address: str,
    steps: list[dict],
    layout: str = "LBHNC",
    name: str = "fake",
    geometry=None,
    tp: tuple[int, int] = (0, 1),
    device: int = 0,
    prefix: tuple[str, ...] = (),
) -> subprocess.Popen:
    """One fake engine worker process on GPU `device`, run through the `prefix` command; `tp` = (its
    rank, the engine's TP size)."""
    spec = {"address": address, "geometry": geometry or GEOMETRY, "layout": layout, "name": name, "steps": steps}
    spec["device"] = device
    spec_json = json.dumps({**spec, "tp_rank": tp[0], "tp_size": tp[1]})
    return subprocess.Popen(
        [*prefix, sys.executable, str(HERE / "fake_engine.py"), spec_json],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def results(process: subprocess.Popen, timeout: float = 120) -> list[dict]:
    out, _ = process.communicate(timeout=timeout)
    assert process.returncode == 0 and "DONE" in out, out[-4000:]
    return [json.loads(line[5:]) for line in out.splitlines() if line.startswith("STEP ")]


def wait_line(process: subprocess.Popen, text: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if text in line:
            return
        assert line or process.poll() is None, "engine exited early"
    raise AssertionError(f"no {text!r}")


def free_gpu_mib(device: int = 0) -> float:
    """Free memory on a GPU as the driver sees it (every process counts, this one included)."""
    torch.cuda.synchronize(device)
    return torch.cuda.mem_get_info(device)[0] / 2**20


@gpu
@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC"])
@pytest.mark.parametrize("targets", ["reversed", "consecutive"])
def test_round_trip_engine_a_to_engine_b_byte_exact(start_daemon, layout, targets):
    """Engine A stores 64 blocks, engine B loads them into other block ids: reversed (the kernel), or
    consecutive (the copy engines: one range of whole blocks for BLHNC, one 2-D copy per layer for
    LBHNC, whose 64 blocks of 64 KiB layers make 4 MiB copies)."""
    geometry = {**GEOMETRY, "num_blocks": 128}
    daemon = start_daemon("--pool-size", "256MiB")
    stored = [{"fill": list(range(64)), "seed": 7}, {"store": list(range(64)), "seed": 7}]
    a = results(engine(daemon.address, stored, layout, geometry=geometry))
    assert a[1]["cuda_ipc"] and a[1]["stored_blocks"] == 64
    ids = list(range(127, 63, -1)) if targets == "reversed" else list(range(64, 128))
    b = results(engine(daemon.address, [{"load": ids, "seed": 7}, {"check": ids, "seed": 7}], layout, geometry=geometry))
    assert b[0]["loaded"] and b[0]["cuda_ipc"]
    assert b[1]["matches"]
    assert "cuda_ipc registered" in daemon.log() and "cuda_ipc closed" in daemon.log()
    # the kernel's checksums are kvtier's: an inline load verifies them with kvtier.checksum on the CPU
    with KVTierClient(daemon.address) as client:
        ns = client.register(namespace_spec(Geometry(**geometry), layout))
        inline = client.load(ns, block_hashes(7, 8), transport="inline")
    assert np.array_equal(inline, seeded_blocks(Geometry(**geometry), 7, 64)[:8].cpu().numpy())


@gpu
def test_blocks_a_later_step_writes_afresh_are_stored_as_they_were(start_daemon):
    """vLLM frees a finished request's blocks at once, even while the daemon is still to copy them
    for a store; a later step that writes them again (fenced first, as handle_preemptions does with
    the blocks the step allocated afresh) changes nothing of what the daemon stores."""
    daemon = start_daemon("--pool-size", "256MiB")
    ids, targets = list(range(8)), list(range(32, 40))
    steps = [{"fill": ids, "seed": 3}, {"store_and_overwrite": ids, "seed": 3, "overwrite_seed": 4}, {"check": ids, "seed": 4}]
    a = results(engine(daemon.address, steps, "BLHNC"))
    assert a[1]["stored_blocks"] == 8 and a[2]["matches"]  # (stored, then written over)
    b = results(engine(daemon.address, [{"load": targets, "seed": 3}, {"check": targets, "seed": 3}], "BLHNC"))
    assert b[0]["loaded"] and b[1]["matches"]


@gpu
def test_a_block_failing_its_checksum_on_a_load_is_dropped_and_stored_again(start_daemon):
    """A block whose bytes in the pool went bad: the cuda_ipc load fails (the engine recomputes), the
    block leaves the daemon, and the engine's next store of it puts good bytes back."""
    daemon = start_daemon("--pool-size", "256MiB")
    store = [{"fill": list(range(8)), "seed": 5}, {"store": list(range(8)), "seed": 5}]
    assert results(engine(daemon.address, store, "BLHNC"))[1]["stored_blocks"] == 8
    bad = block_hashes(5, 8)[3]
    namespace = daemon.admin("ListNamespaces").namespaces[0].namespace
    info, inspected = daemon.admin("GetInfo"), daemon.admin("InspectBlock", namespace=namespace, hash=bad)
    pool = PoolMapping(info.pool.shm_path, info.pool.size_bytes, info.pool.page_size)
    pool.view.pages[decode_page_ids(inspected.page_ids, len(inspected.page_ids) // 4)[0, 0], :64] ^= 0x5A
    pool.close()
    load = [{"load": list(range(8, 16)), "seed": 5}]
    assert not results(engine(daemon.address, load, "BLHNC"))[0]["loaded"]
    held = {b.hash for b in daemon.admin("ListBlocks", namespace=namespace).blocks}
    assert bad not in held and len(held) == 7 and "failed their checksum on a load; dropped" in daemon.log()
    results(engine(daemon.address, store, "BLHNC"))
    assert bad in {b.hash for b in daemon.admin("ListBlocks", namespace=namespace).blocks}
    again = results(engine(daemon.address, [*load, {"check": list(range(8, 16)), "seed": 5}], "BLHNC"))
    assert again[0]["loaded"] and again[1]["matches"]


@gpu
def test_a_gpus_link_is_measured_at_its_first_registration(start_daemon):
    """The daemon expects each copy's end at the GPU's own link rate (at least PCIe Gen5's): a
    faster link (NVLink-C2C) is not waited on as if it were PCIe."""
    daemon = start_daemon("--pool-size", "256MiB")
    with KVTierClient(daemon.address, timeout=30) as client:
        registered_cache(client)
        registered_cache(client, "LBHNC")  # (the same GPU: measured once)
    measured = [line for line in daemon.log().splitlines() if "cuda_ipc link measured" in line]
    assert len(measured) == 1
    rate = float(measured[0].split("GBps=")[1].split()[0])
    assert 55 <= rate < 2000, measured


@gpu
def test_a_load_the_engine_writes_over_fails_but_the_pool_keeps_its_good_blocks(start_daemon):
    """An engine writing into a load's target blocks while the daemon copies (a bug on its side):
    the load fails its check in place and the engine recomputes, but the blocks' pool bytes are read
    again before anything is dropped, and being intact they stay for every other engine."""
    daemon = start_daemon("--pool-size", "256MiB")
    geometry = Geometry(**GEOMETRY)
    with KVTierClient(daemon.address, timeout=30) as client:
        buffer, kv, ns = registered_cache(client)
        hashes, data = block_hashes(14, 8), seeded_blocks(geometry, 14, 8)
        assert client.store(ns, hashes, data.cpu().numpy()) == 8
        targets = buffer.view(torch.uint8)[16 * geometry.block_bytes : 24 * geometry.block_bytes]  # (BLHNC: blocks 16-23)
        scattered = torch.randint(0, targets.numel(), (1 << 26,), device=targets.device)
        scribbler = torch.cuda.Stream()
        with torch.cuda.stream(scribbler):  # zeros written all over the targets for a good while
            for _ in range(200):
                targets.index_fill_(0, scattered, 0)
        with pytest.raises(grpc.RpcError) as failed:
            client.load_cuda(ns, list(range(16, 24)), hashes)
        scribbler.synchronize()
        assert failed.value.code() == grpc.StatusCode.DATA_LOSS
        assert client.lookup(ns, hashes).hit_count == 8
        assert client.load_cuda(ns, list(range(16, 24)), hashes) == 8
        assert torch.equal(targets.view(8, -1), data)
    assert "intact in the pool; kept" in daemon.log() and "dropped" not in daemon.log()


@gpu
def test_a_layer_major_load_ending_at_the_pools_and_the_caches_last_bytes_is_byte_exact(start_daemon):
    """A load's 2-D copies (one per layer, a row per block) whose rows end at the pool's last byte and
    the cache's: each copy's pitch reaches past its last row, which the driver must not read."""
    geometry = Geometry(**GEOMETRY)
    size = geometry.num_blocks * geometry.block_bytes
    daemon = start_daemon("--pool-size", str(size))  # room for the whole cache and no more
    with KVTierClient(daemon.address, timeout=30) as client:
        _, kv, ns = registered_cache(client, "LBHNC")
        hashes, data = block_hashes(15, geometry.num_blocks), seeded_blocks(geometry, 15, geometry.num_blocks)
        assert client.store(ns, hashes, data.cpu().numpy()) == geometry.num_blocks
        last = daemon.admin("InspectBlock", namespace=ns.id, hash=hashes[-1])
        page_size = daemon.admin("GetInfo").pool.page_size
        assert (decode_page_ids(last.page_ids, len(last.page_ids) // 4)[0, -1] + 1) * page_size == size
        assert client.load_cuda(ns, list(range(geometry.num_blocks)), hashes) == geometry.num_blocks
        assert torch.equal(torch.cat([run.rows for run in kv.runs], dim=1), data)


def registered_cache(client: KVTierClient, layout: str = "BLHNC"):
    """A KV cache in this process, registered for cuda_ipc: (its buffer, GpuKV, namespace)."""
    from kvtier.engine.gpu_kv import GpuKV  # noqa: PLC0415 (needs CUDA)

    geometry = Geometry(**GEOMETRY)
    buffer, views = allocate_kv_cache(geometry, layout)
    kv = GpuKV(list(views.values()), geometry.num_blocks)
    ns = client.register(namespace_spec(geometry, layout), kv.describe())
    assert ns.cuda_registration, ns.cuda_refused
    return buffer, kv, ns


def slow_forward(kv, seed: int, gpu_cycles: int) -> tuple[torch.Tensor, int]:
    """As a forward that runs `gpu_cycles` and then writes seeded data into blocks 0-7, queued on the
    compute stream (not waited for) and followed by a ready event; the [8, block_bytes] data and the
    event's index in the ring (its store names it)."""
    data = seeded_blocks(Geometry(**GEOMETRY), seed, 8)
    torch.cuda._sleep(gpu_cycles)
    start = 0
    for run in kv.runs:
        run.rows[:8] = data[:, start : start + run.run.size]
        start += run.run.size
    return data, kv.record_ready()


@gpu
def test_an_allocation_claiming_more_than_its_memory_is_refused(start_daemon):
    """The daemon's copies go by the sizes a registration claims. A claim past the memory the IPC
    handle really opens (a copy there would fault, and a fault poisons the daemon's CUDA context for
    every engine) is refused at Register; the daemon goes on serving."""
    daemon = start_daemon("--pool-size", "256MiB")
    geometry = Geometry(**GEOMETRY)
    with KVTierClient(daemon.address, timeout=30) as client:
        from kvtierd.gpu_transfers import _allocation_range

        buffer, kv, ns = registered_cache(client)
        base, size = _allocation_range(buffer.data_ptr())  # the allocator's segment the cache lies in
        blocks = (base + size - buffer.data_ptr()) // geometry.block_bytes + 1  # one block past its end
        cache = kv.describe()
        cache.allocations[0].size_bytes = blocks * geometry.block_bytes  # (the runs still fit the claim)
        cache.num_blocks = blocks
        claimed = client.register(namespace_spec(geometry, "BLHNC"), cache)
        assert not claimed.cuda_registration and "the memory its handle opens has" in claimed.cuda_refused
        hashes = block_hashes(2, 8)
        assert client.store(ns, hashes, seeded_blocks(geometry, 2, 8).cpu().numpy()) == 8
        assert client.load_cuda(ns, list(range(8)), hashes) == 8  # the truthful registration serves
    assert daemon.process.poll() is None


@gpu
def test_registering_a_namespace_again_closes_the_sessions_earlier_registration(start_daemon):
    """A session that registers its cache again for the same namespace (the connector does after a
    change of plan), or for another one (after a prefix cache reset), gets a new registration and the
    earlier one closes, instead of mappings piling up until the session ends."""
    daemon = start_daemon("--pool-size", "256MiB")
    geometry = Geometry(**GEOMETRY)
    with KVTierClient(daemon.address, timeout=30) as client:
        _, kv, first = registered_cache(client)
        again = client.register(namespace_spec(geometry, "BLHNC"), kv.describe())
        assert again.cuda_registration and again.cuda_registration != first.cuda_registration
        assert daemon.log().count("cuda_ipc closed") == 1
        hashes = block_hashes(8, 8)
        assert client.store(again, hashes, seeded_blocks(geometry, 8, 8).cpu().numpy()) == 8
        with pytest.raises(grpc.RpcError) as closed:
            client.load_cuda(first, list(range(8)), hashes)
        assert closed.value.code() == grpc.StatusCode.NOT_FOUND
        assert client.load_cuda(again, list(range(8)), hashes) == 8
        # the same cache for another namespace (after vLLM reset its prefix cache): the earlier one goes too
        other_spec = namespace_spec(geometry, "BLHNC")
        other_spec.extra["reset"] = "1"
        other = client.register(other_spec, kv.describe())
        assert other.cuda_registration and daemon.log().count("cuda_ipc closed") == 2
        assert client.store(other, hashes, seeded_blocks(geometry, 8, 8).cpu().numpy()) == 8
        assert client.load_cuda(other, list(range(8, 16)), hashes) == 8


@gpu
def test_a_load_the_daemon_reaches_after_its_deadline_is_not_copied(start_daemon):
    """An engine stops waiting for a cuda_ipc load soon after its deadline and may then reuse the
    blocks (vLLM frees a failed request's blocks). A daemon that gets to the load only after the
    deadline (here: stopped meanwhile, as by a long pause) answers DEADLINE_EXCEEDED and copies nothing."""
    daemon = start_daemon("--pool-size", "256MiB")
    geometry = Geometry(**GEOMETRY)
    with KVTierClient(daemon.address, timeout=30) as client:
        buffer, kv, ns = registered_cache(client)
        hashes = block_hashes(3, 8)
        assert client.store(ns, hashes, seeded_blocks(geometry, 3, 8).cpu().numpy()) == 8
        daemon.process.send_signal(signal.SIGSTOP)
        resume = threading.Timer(1.0, daemon.process.send_signal, (signal.SIGCONT,))
        resume.start()
        with pytest.raises(grpc.RpcError) as late:
            client.load_cuda(ns, list(range(8)), hashes, deadline_ns=time.monotonic_ns() + 300_000_000)
        resume.join()
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and late.value.answered  # (the daemon's status)
        time.sleep(0.2)
        torch.cuda.synchronize()
        assert not buffer.any()  # nothing landed in the engine's blocks
        assert client.load_cuda(ns, list(range(8)), hashes) == 8  # in time: copied
        assert torch.equal(torch.cat([r.rows[:8] for r in kv.runs], dim=1), seeded_blocks(geometry, 3, 8))


@gpu
def test_a_store_whose_blocks_are_not_ready_by_its_deadline_is_not_copied(start_daemon):
    """The daemon's store copy waits for the engine's ready event. Once the deadline has passed the
    engine may reuse the blocks, so bytes copied after it may be another request's: a store whose
    forward has not ended by the deadline is refused (DEADLINE_EXCEEDED), nothing copied or committed.
    (The daemon also commits no store whose copy it sees ending after the deadline, a backstop for a
    copy slower than its estimate, which no test here can make happen on demand.)"""
    daemon = start_daemon("--pool-size", "256MiB")
    with KVTierClient(daemon.address, timeout=30) as client:
        _, kv, ns = registered_cache(client)
        hashes = block_hashes(4, 8)
        torch.cuda._sleep(3_000_000_000)  # a forward of about 1.5 s before the blocks are ready
        ready = kv.record_ready()
        with pytest.raises(grpc.RpcError) as late:
            client.store_cuda(ns, hashes, list(range(8)), ready, deadline_ns=time.monotonic_ns() + 300_000_000)
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, late.value.details()
        assert client.lookup(ns, hashes).hit_count == 0
        with pytest.raises(grpc.RpcError) as outside:  # a slot beyond the ring: refused before any reservation
            client.store_cuda(ns, hashes, list(range(8)), len(kv.ready_events))
        assert outside.value.code() == grpc.StatusCode.INVALID_ARGUMENT, outside.value.details()
        torch.cuda.synchronize()
        assert client.store_cuda(ns, hashes, list(range(8)), kv.record_ready()) == 8  # ready in time: committed


@gpu
def test_a_store_without_a_deadline_waits_for_its_forward_no_longer_than_the_lease_ttl(start_daemon):
    """deadline_ns 0: the reservation would otherwise wait for a forward that never ends, its pages
    held (it neither expires nor can be aborted while its copy waits)."""
    from kvtier import ops  # noqa: PLC0415

    daemon = start_daemon("--pool-size", "256MiB", "--lease-ttl", "0.5")
    with KVTierClient(daemon.address, timeout=30) as client:
        _, kv, ns = registered_cache(client)
        hashes = block_hashes(9, 4)
        torch.cuda._sleep(6_000_000_000)  # a forward of about 3 s
        ready = kv.record_ready()
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as late:
            client._run(ops.store_cuda(client.state, ns, hashes, list(range(4)), ready, 0), timeout=30)
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, late.value.details()
        assert time.monotonic() - started < 2.0 and daemon.admin("GetStats").reserved_bytes == 0
        torch.cuda.synchronize()


@gpu
def test_a_load_naming_one_device_block_twice_is_refused_and_drops_nothing(start_daemon):
    """Two copies into one engine block would fail its check in place: the good pool block would be
    dropped as corrupt for every engine."""
    daemon = start_daemon("--pool-size", "256MiB")
    with KVTierClient(daemon.address, timeout=30) as client:
        _, kv, ns = registered_cache(client)
        hashes = block_hashes(10, 4)
        assert client.store_cuda(ns, hashes, list(range(4)), kv.record_ready()) == 4
        with pytest.raises(grpc.RpcError) as refused:
            client.load_cuda(ns, [10, 11, 11, 12], hashes)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "distinct" in refused.value.details()
        assert client.load_cuda(ns, [10, 11, 12, 13], hashes) == 4


@gpu
def test_a_store_waiting_for_its_engines_forward_holds_up_no_other_engines_copies(start_daemon):
    """The daemon's copy lanes serve every engine on the GPU. A store waits for its engine's forward
    (the ready event) on the host, not on a lane: another engine's loads take their usual time
    meanwhile, and the store still copies what the forward wrote."""
    from kvtierd.gpu_transfers import LANES_PER_DEVICE

    daemon = start_daemon("--pool-size", "256MiB")
    geometry = Geometry(**GEOMETRY)
    with KVTierClient(daemon.address, timeout=30) as a_client, KVTierClient(daemon.address, timeout=30) as b_client:
        _, a, a_ns = registered_cache(a_client)
        _, _, b_ns = registered_cache(b_client)
        b_hashes = block_hashes(6, 8)
        assert b_client.store(b_ns, b_hashes, seeded_blocks(geometry, 6, 8).cpu().numpy()) == 8
        forward, ready = slow_forward(a, 9, gpu_cycles=3_000_000_000)  # engine A's: about 1.5 s
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            store = pool.submit(a_client.store_cuda, a_ns, block_hashes(9, 8), list(range(8)), ready)
            times = []
            for _ in range(2 * LANES_PER_DEVICE):  # engine B's loads go round every lane
                started = time.monotonic()
                assert b_client.load_cuda(b_ns, list(range(8)), b_hashes) == 8
                times.append(time.monotonic() - started)
            assert not store.done()  # A's forward is still running
            assert max(times) < 0.5, times
            assert store.result(timeout=30) == 8
        stored = a_client.load(a_ns, block_hashes(9, 8), transport="inline")
        assert np.array_equal(stored, forward.cpu().numpy())


@gpu
def test_a_store_waits_for_the_forward_it_follows_not_for_later_ones(start_daemon):
    """With vLLM's async scheduling the engine records its ready event for the next step before this
    step's forward is done, step after step. A store waits for the record current when it arrived;
    under steady load the latest record is never done, so waiting for that would hold it for ever."""
    daemon = start_daemon("--pool-size", "256MiB")
    with KVTierClient(daemon.address, timeout=30) as client:
        _, kv, ns = registered_cache(client)
        forward, ready = slow_forward(kv, 11, gpu_cycles=2_000_000_000)  # this step's: about a second
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            store = pool.submit(client.store_cuda, ns, block_hashes(11, 8), list(range(8)), ready)
            started = time.monotonic()
            while not store.done() and time.monotonic() - started < 4:  # later steps, queued ahead of the GPU
                torch.cuda._sleep(200_000_000)
                kv.record_ready()
                time.sleep(0.05)
            assert store.done(), "the store waited for later steps' records"
            assert store.result() == 8
        torch.cuda.synchronize()
        assert np.array_equal(client.load(ns, block_hashes(11, 8), transport="inline"), forward.cpu().numpy())


@gpu
def test_a_store_waiting_for_its_engines_forward_longer_than_the_lease_ttl_keeps_its_pages(start_daemon):
    """A CUDA store's reservation outlives --lease-ttl while the store waits for its engine's forward
    and copies (its pages freed meanwhile would go to other blocks under the copy); it commits."""
    daemon = start_daemon("--pool-size", "256MiB", "--lease-ttl", "0.4")
    with KVTierClient(daemon.address, timeout=30) as client:
        _, kv, ns = registered_cache(client)
        forward, ready = slow_forward(kv, 12, gpu_cycles=2_000_000_000)  # about a second
        deadline_ns = time.monotonic_ns() + 20_000_000_000
        assert client.store_cuda(ns, block_hashes(12, 8), list(range(8)), ready, deadline_ns) == 8
        assert np.array_equal(client.load(ns, block_hashes(12, 8), transport="inline"), forward.cpu().numpy())
    assert "expired holds" not in daemon.log()


@gpu
def test_a_store_refused_during_its_engines_forward_holds_up_neither_other_engines_nor_shutdown(start_daemon):
    """A store refused for its deadline while its engine's forward still runs (6 s, or an engine hung in
    it). Nothing else waits for that forward: another engine's calls and its session ending (closing
    its mappings synchronizes the device), a third engine's calls, and the daemon's shutdown. (Fails
    where any daemon stream waits on the GPU for an engine's ready event, as a gate stream did.)"""
    daemon = start_daemon("--pool-size", "256MiB")
    geometry = Geometry(**GEOMETRY)
    b_client = KVTierClient(daemon.address, timeout=30).connect()  # (B's CUDA work is done first: in this
    _, _, b_ns = registered_cache(b_client)  # process it would wait for A's forward on the same GPU)
    hashes, b_data = block_hashes(13, 8), seeded_blocks(geometry, 13, 8).cpu().numpy()
    with KVTierClient(daemon.address, timeout=30) as a_client:
        _, a, a_ns = registered_cache(a_client)
        _, ready = slow_forward(a, 12, gpu_cycles=12_000_000_000)  # about 6 s
        with pytest.raises(grpc.RpcError) as late:
            a_client.store_cuda(a_ns, block_hashes(12, 8), list(range(8)), ready, deadline_ns=time.monotonic_ns() + 300_000_000)
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        started = time.monotonic()
        steps = []
        assert b_client.store(b_ns, hashes, b_data) == 8
        steps.append(time.monotonic() - started)
        assert b_client.load_cuda(b_ns, list(range(8)), hashes) == 8
        steps.append(time.monotonic() - started)
        b_client.close()
        steps.append(time.monotonic() - started)
        while "cuda_ipc closed" not in daemon.log() and time.monotonic() - started < 10:  # B's session ended
            time.sleep(0.01)
        steps.append(time.monotonic() - started)
        with KVTierClient(daemon.address, timeout=30) as c_client:
            c_ns = c_client.register(namespace_spec(geometry, "BLHNC"))
            assert c_client.lookup(c_ns, hashes).hit_count == 8
        steps.append(time.monotonic() - started)
        assert time.monotonic() - started < 3, steps
        started = time.monotonic()
        assert daemon.stop() == 0
        assert time.monotonic() - started < 3


@gpu
def test_two_engines_store_and_load_concurrently(start_daemon, tmp_path):
    daemon = start_daemon("--pool-size", "256MiB")
    go = tmp_path / "go"
    steps = lambda mine, theirs: [  # noqa: E731
        {"fill": list(range(32)), "seed": mine},
        {"store": list(range(32)), "seed": mine},
        {"wait_for": str(go)},
        {"load": list(range(32, 64)), "seed": theirs},
        {"check": list(range(32, 64)), "seed": theirs},
    ]
    a, b = engine(daemon.address, steps(1, 2), name="a"), engine(daemon.address, steps(2, 1), name="b")
    time.sleep(0.1)
    deadline = time.monotonic() + 60
    while daemon.admin("GetStats").tiers[0].blocks < 64 and time.monotonic() < deadline:
        time.sleep(0.05)
    go.touch()
    for process in (a, b):
        steps_done = results(process)
        assert steps_done[3]["loaded"] and steps_done[4]["matches"]


@gpu
def test_tensor_parallel_ranks_keep_their_own_blocks(start_daemon):
    """Two TP=2 engines (one worker process per rank, here both ranks on one GPU): the ranks share one
    namespace, the same block hashes hold each rank's own bytes (keys with the rank), and each rank of
    engine 2 loads its own rank's blocks."""
    daemon = start_daemon("--pool-size", "256MiB")
    ids = list(range(16))
    steps = [[{"fill": ids, "seed": 40 + rank}, {"store": ids, "seed": 40 + rank, "hash_seed": 7}] for rank in (0, 1)]
    writers = [engine(daemon.address, steps[rank], tp=(rank, 2)) for rank in (0, 1)]
    for process in writers:
        assert results(process)[1]["stored_blocks"] == 16
    targets = list(range(32, 48))
    readers = [
        engine(
            daemon.address,
            [{"load": targets, "seed": 40 + rank, "hash_seed": 7}, {"check": targets, "seed": 40 + rank}],
            tp=(rank, 2),
        )
        for rank in (0, 1)
    ]
    for process in readers:
        loaded, checked = results(process)
        assert loaded["loaded"] and loaded["cuda_ipc"] and checked["matches"]
    (namespace,) = daemon.admin("ListNamespaces").namespaces  # the ranks' one, each rank's blocks under its own keys
    assert namespace.blocks == 32


@gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (device kind nvidia-h200-x2)")
def test_tensor_parallel_engines_on_two_gpus(start_daemon, tmp_path):
    """Two TP=2 engines, one worker process per GPU, against one daemon: each rank registers its own
    GPU by UUID, engine 2's ranks load engine 1's blocks byte-exact into their own GPUs; then one rank
    of a third engine is killed mid-store: the daemon closes that rank's mapping (its GPU memory comes
    back) while the other rank keeps storing and loading, and nothing stays reserved or pinned."""
    daemon = start_daemon("--pool-size", "512MiB", "--lease-ttl", "600s")
    ids, targets = list(range(16)), list(range(32, 48))
    store = [[{"fill": ids, "seed": 60 + r}, {"store": ids, "seed": 60 + r, "hash_seed": 9}] for r in (0, 1)]
    writers = [engine(daemon.address, store[r], "BLHNC", tp=(r, 2), device=r) for r in (0, 1)]
    for process in writers:
        stored = results(process)[1]
        assert stored["cuda_ipc"] and stored["stored_blocks"] == 16
    readers = [
        engine(
            daemon.address,
            [{"load": targets, "seed": 60 + r, "hash_seed": 9}, {"check": targets, "seed": 60 + r}],
            "BLHNC",  # consecutive blocks in consecutive pool pages: the loads go through the copy engines
            tp=(r, 2),
            device=r,
        )
        for r in (0, 1)
    ]
    for process in readers:
        loaded, checked = results(process)
        assert loaded["loaded"] and loaded["cuda_ipc"] and checked["matches"]
    registered = [line for line in daemon.log().splitlines() if "cuda_ipc registered" in line]
    assert any("device=0" in line for line in registered) and any("device=1" in line for line in registered)

    big = {**GEOMETRY, "num_blocks": 4096}  # 1 GiB per rank: a kept mapping would show
    free_before = free_gpu_mib(1)
    go = tmp_path / "go"
    survivor = engine(
        daemon.address,
        [
            {"fill": ids, "seed": 70},
            {"store": ids, "seed": 70, "hash_seed": 11},
            {"wait_for": str(go)},
            {"store": ids, "seed": 70, "hash_seed": 12},
            {"load": targets, "seed": 70, "hash_seed": 12},
            {"check": targets, "seed": 70},
        ],
        geometry=big,
        tp=(0, 2),
        device=0,
    )
    victim = engine(daemon.address, [{"fill": ids, "seed": 71}, {"store_forever": ids}], geometry=big, tp=(1, 2), device=1)
    wait_line(victim, "STORING")
    closed_before = daemon.log().count("cuda_ipc closed")
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and daemon.log().count("cuda_ipc closed") == closed_before:
        time.sleep(0.1)
    while time.monotonic() < deadline and free_gpu_mib(1) < free_before - 512:
        time.sleep(0.2)
    assert free_gpu_mib(1) >= free_before - 512, "the killed rank's KV cache is still mapped"
    go.touch()
    steps = results(survivor)
    assert steps[1]["stored_blocks"] == 16 and steps[3]["stored_blocks"] == 16
    assert steps[4]["loaded"] and steps[5]["matches"]
    stats = daemon.admin("GetStats")
    assert stats.reserved_bytes == 0 and stats.pinned_blocks == 0
    assert daemon.process.poll() is None


@gpu
def test_engine_killed_mid_store_releases_mappings_and_reservations(start_daemon):
    daemon = start_daemon("--pool-size", "256MiB", "--lease-ttl", "600s")
    free_before = free_gpu_mib()  # the daemon's CUDA context already exists (it registered its pool)
    big = {**GEOMETRY, "num_blocks": 4096}  # a 1 GiB KV cache: a leaked mapping would show
    process = engine(daemon.address, [{"fill": list(range(64)), "seed": 3}, {"store_forever": list(range(64))}], geometry=big)
    wait_line(process, "STORING")
    assert free_gpu_mib() < free_before - 1024
    process.send_signal(signal.SIGKILL)
    process.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and "engine disconnected" not in daemon.log():  # (logged once all is let go)
        time.sleep(0.1)
    assert "cuda_ipc closed" in daemon.log()
    stats = daemon.admin("GetStats")
    assert stats.reserved_bytes == 0 and stats.pinned_blocks == 0
    deadline = time.monotonic() + 30
    # the daemon itself grows a little on first use (kernel, buffers); a kept mapping would hold 1 GiB
    while time.monotonic() < deadline and free_gpu_mib() < free_before - 512:
        time.sleep(0.2)
    assert free_gpu_mib() >= free_before - 512, "the dead engine's KV cache is still mapped"
    assert daemon.process.poll() is None


@gpu
def test_daemon_restart_engines_reconnect(start_daemon, tmp_path):
    args = ["--pool-size", "128MiB"]
    daemon = start_daemon(*args)
    restarted = tmp_path / "restarted"
    process = engine(
        daemon.address,
        [
            {"fill": list(range(16)), "seed": 5},
            {"store": list(range(16)), "seed": 5},
            {"wait_for": str(restarted)},
            {"store": list(range(16)), "seed": 5},
        ],
    )
    wait_line(process, "STEP")
    wait_line(process, "STEP")
    assert daemon.stop() == 0
    again = DaemonProcess(daemon.directory, args).start()
    try:
        restarted.touch()
        steps = results(process)
        assert steps[-1]["cuda_ipc"] and steps[-1]["stored_blocks"] == 16  # re-registered with the new daemon
        b = results(engine(again.address, [{"load": list(range(16, 32)), "seed": 5}, {"check": list(range(16, 32)), "seed": 5}]))
        assert b[0]["loaded"] and b[1]["matches"]
    finally:
        again.stop()


@gpu
@pytest.mark.parametrize("cuda_register", ["true", "false"])  # the daemon copies (cuda_ipc), or the engine (shm)
def test_stores_and_loads_over_the_batch_limit_go_in_several_calls(start_daemon, cuda_register):
    daemon = start_daemon("--pool-size", "128MiB", "--max-batch-blocks", "8", "--cuda-register", cuda_register)
    steps = [
        {"fill": list(range(20)), "seed": 6},
        {"store": list(range(20)), "seed": 6},
        {"load": list(range(30, 50)), "seed": 6},
        {"check": list(range(30, 50)), "seed": 6},
    ]
    out = results(engine(daemon.address, steps))
    assert out[1]["stored_blocks"] == 20 and out[2]["loaded"] and out[3]["matches"]
    assert out[1]["cuda_ipc"] == (cuda_register == "true")
    assert "request refused" not in daemon.log()


@gpu
def test_fallback_to_shm_when_the_daemon_refuses_cuda_ipc(start_daemon):
    daemon = start_daemon("--pool-size", "128MiB", "--cuda-register", "false")
    a = results(engine(daemon.address, [{"fill": list(range(20)), "seed": 9}, {"store": list(range(20)), "seed": 9}]))
    assert not a[1]["cuda_ipc"] and a[1]["stored_blocks"] == 20
    b = results(engine(daemon.address, [{"load": list(range(40, 60)), "seed": 9}, {"check": list(range(40, 60)), "seed": 9}]))
    assert b[0]["loaded"] and not b[0]["cuda_ipc"] and b[1]["matches"]


def as_user(uid: int, gid: int, groups: tuple[int, ...], env: dict[str, str]) -> tuple[str, ...]:
    """A command prefix that runs the command as `uid` (the caller must be root) with `env` added."""
    switch = (
        "import os, sys; "
        f"os.setgroups({list(groups)}); os.setgid({gid}); os.setuid({uid}); os.environ.update({env!r}); "
        "os.execv(sys.argv[1], sys.argv[1:])"
    )
    return (sys.executable, "-c", switch)


def systemd_environment(cache_directory: Path) -> dict[str, str]:
    """The Environment= of deploy/systemd/kvtierd.service, its CacheDirectory at `cache_directory`."""
    unit = (HERE.parent / "deploy" / "systemd" / "kvtierd.service").read_text()
    lines = [line.removeprefix("Environment=") for line in unit.splitlines() if line.startswith("Environment=")]
    pairs = [word.split("=", 1) for line in lines for word in shlex.split(line)]
    return {key: value.replace("/var/cache/kvtierd", str(cache_directory)) for key, value in pairs}


@gpu
@pytest.mark.skipif(os.geteuid() != 0, reason="runs the daemon and engines as other users: needs root")
@pytest.mark.parametrize("engine_user", ["the daemon's", "another of its group"])
def test_engines_of_a_daemon_run_by_the_systemd_unit(engine_user):
    """The systemd unit's setup: the daemon runs as a system user of its own (no home; the unit's
    environment), with the socket and the pool 0660. An engine of the same user gets cuda_ipc (the
    daemon compiled its kernel). CUDA opens IPC handles only between processes of one user, so an
    engine of another user in the daemon's group is refused cuda_ipc, with the reason, and copies
    through shared memory itself."""
    daemon_uid, group = 61001, 61001
    engine_uid = daemon_uid if engine_user == "the daemon's" else 61002
    cache, engine_home = Path(tempfile.mkdtemp(prefix="kvt-cache-")), Path(tempfile.mkdtemp(prefix="kvt-home-"))
    os.chown(cache, daemon_uid, group)
    os.chown(engine_home, engine_uid, engine_uid)
    unit_environment = {"HOME": "/nonexistent", **systemd_environment(cache)}
    daemon = DaemonProcess(
        new_daemon_dir(),
        ["--pool-size", "128MiB", "--socket-mode", "0660", "--shm-mode", "0660"],
        prefix=list(as_user(daemon_uid, group, (), unit_environment)),
    )
    for directory in (daemon.directory, daemon.shm_dir):
        directory.mkdir(exist_ok=True)
        os.chown(directory, daemon_uid, group)
        directory.chmod(0o750)
    try:
        daemon.start()
        steps = [
            {"fill": list(range(16)), "seed": 4},
            {"store": list(range(16)), "seed": 4},
            {"load": list(range(32, 48)), "seed": 4},
            {"check": list(range(32, 48)), "seed": 4},
        ]
        as_engine = as_user(engine_uid, engine_uid, (group,), {"HOME": str(engine_home)})
        out = results(engine(daemon.address, steps, prefix=as_engine))
        assert out[1]["stored_blocks"] == 16 and out[2]["loaded"] and out[3]["matches"], daemon.log()[-3000:]
        assert os.stat(daemon.socket).st_uid == daemon_uid  # (the daemon did run as its own user)
        if engine_uid == daemon_uid:
            assert out[1]["cuda_ipc"] and out[2]["cuda_ipc"]
            assert "refused" not in daemon.log()
        else:
            assert not out[1]["cuda_ipc"] and not out[2]["cuda_ipc"]
            assert "cuda_ipc refused" in daemon.log() and "one user" in daemon.log()
        assert daemon.stop() == 0
    finally:
        daemon.stop()
        remove_daemon_dir(daemon.directory)
        shutil.rmtree(cache, ignore_errors=True)
        shutil.rmtree(engine_home, ignore_errors=True)


@gpu
def test_daemon_gpu_memory_overhead(start_daemon):
    """Measured and reported (tests/results are printed with -s): the daemon's CUDA context, streams
    and kernel on one GPU, after it served cuda_ipc for an engine that has exited."""
    free_before = free_gpu_mib()
    daemon = start_daemon("--pool-size", "128MiB")
    results(engine(daemon.address, [{"fill": [0], "seed": 1}, {"store": [0], "seed": 1}, {"load": [1], "seed": 1}]))
    overhead = free_before - free_gpu_mib()
    print(f"\nGPU memory overhead of the daemon: {overhead:.0f} MiB")
    assert 0 < overhead < 2048
