"""GPU <-> pool transfer speed through the daemon (TRANSPORT_CUDA_IPC), against raw pinned memcpy, in one run.

On a CUDA machine: raw pinned host<->device memcpy (the physical limit), then store and load through a
real kvtierd for batches of 1, 16, 64 and 512 blocks of a Llama-3-8B-like layout (32 layers, 8 KV
heads, head size 128, 16 tokens per block, bf16: 2 MiB per block) in the layer-major (LBHNC) and
block-outermost (BLHNC) layouts, and one 170 MB prefix load end to end (one Load call: RPC, pinning,
copy, checksum verification, answer; the daemon releases the blocks just after answering) against a
raw memcpy of the same bytes. This process plays the engine (tests/fake_engine.py allocates its KV
cache as vLLM 0.33 does). Every time is a median; a store or load time runs from the call to its
answer (one call at a time back to back, or 4 in flight: the median of 3 runs). Writes bench/results/transfer_gpu.json and
transfer_gpu.png. Usage: python bench/transfer_gpu.py [--rounds N]
"""

from __future__ import annotations

import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from common import RESULTS, pyplot, start_daemon, stop_daemon, write_result  # isort: skip

from fake_engine import Geometry, allocate_kv_cache, block_hashes, namespace_spec  # noqa: E402

from kvtier.client import KVTierClient  # noqa: E402
from kvtier.engine.gpu_kv import GpuKV  # noqa: E402

LLAMA3_8B = Geometry(layers=32, heads=8, block_size=16, head_size=128, num_blocks=2048, dtype="bfloat16")
CALLERS = 4  # sustained throughput: this many calls in flight (engines issue stores and loads asynchronously)
WINDOWS = 3  # sustained throughput: the median of this many runs of `rounds` calls per caller
BATCHES = [1, 16, 64, 512]
PREFIX_BYTES = 170_000_000
PREFIX_ROUND_FACTOR = 4  # the prefix's median is of this many times more calls (a few ms each; one-call times vary)


def memcpy_seconds(nbytes: int, to_device: bool, rounds: int) -> float:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    src, dst = (host, device) if to_device else (device, host)
    samples = []
    for _ in range(rounds + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1000)
    return statistics.median(samples[2:])


def timed(fn, rounds: int) -> float:
    samples = []
    for _ in range(rounds + 2):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples[2:])


def sustained_GBps(call, n: int, rounds: int) -> float:
    """Bytes per second with CALLERS threads each issuing `rounds` calls `call(caller)` back to back:
    the median of WINDOWS such runs (as memcpy's figure is a median: one stall of the host, a
    collection or another process, is not taken for the daemon's rate)."""
    rates = []
    with ThreadPoolExecutor(CALLERS) as pool:
        list(pool.map(call, range(CALLERS)))  # warm-up
        for _ in range(WINDOWS):
            started = time.perf_counter()
            list(pool.map(lambda caller: [call(caller) for _ in range(rounds)], range(CALLERS)))
            rates.append(CALLERS * rounds * n * LLAMA3_8B.block_bytes / (time.perf_counter() - started) / 1e9)
    return statistics.median(rates)


def through_daemon(address: str, layout: str, rounds: int) -> dict:
    g = LLAMA3_8B
    _, views = allocate_kv_cache(g, layout)
    kv = GpuKV(list(views.values()), g.num_blocks)
    result = {"store_GBps": {}, "load_GBps": {}, "store_sustained_GBps": {}, "load_sustained_GBps": {}}
    with KVTierClient(address, engine_name=f"bench-{layout}", timeout=60) as client:
        ns = client.register(namespace_spec(g, layout), kv.describe())
        assert ns.cuda_registration, ns.cuda_refused
        seed = iter(range(1_000_000))

        def fresh(n: int, batches: int):
            """Hashes for `batches` stores of `n` new blocks, made before the clock starts (an engine has
            its hashes from vLLM); thread-safe (a list iterator's next holds the GIL)."""
            return iter([block_hashes(next(seed) + 1000 * n, n) for _ in range(batches)])

        for n in BATCHES:
            ids = list(range(n))

            one_call_batches = fresh(n, rounds + 2)

            def store(n=n, ids=ids, batches=one_call_batches):
                assert client.store_cuda(ns, next(batches), ids, kv.record_ready()) == n

            result["store_GBps"][n] = n * g.block_bytes / timed(store, rounds) / 1e9
            hashes = block_hashes(-n, n)
            client.store_cuda(ns, hashes, ids, kv.record_ready())
            targets = list(range(g.num_blocks - n, g.num_blocks))
            result["load_GBps"][n] = (
                n * g.block_bytes / timed(lambda n=n, h=hashes, t=targets: client.load_cuda(ns, t, h), rounds) / 1e9
            )
            if n < 64:
                continue
            ready, in_flight_batches = kv.record_ready(), fresh(n, CALLERS * (WINDOWS * rounds + 1))

            def store_fresh(caller, n=n, ready=ready, batches=in_flight_batches):
                assert client.store_cuda(ns, next(batches), list(range(caller * n, (caller + 1) * n)), ready) == n

            def load_again(caller, n=n, h=hashes):
                assert client.load_cuda(ns, list(range(caller * n, (caller + 1) * n)), h) == n

            result["load_sustained_GBps"][n] = sustained_GBps(load_again, n, rounds)  # before stores evict `hashes`
            result["store_sustained_GBps"][n] = sustained_GBps(store_fresh, n, rounds)
        prefix = -(-PREFIX_BYTES // g.block_bytes)
        hashes = block_hashes(-99, prefix)
        client.store_cuda(ns, hashes, list(range(prefix)), kv.record_ready())
        load_s = timed(lambda: client.load_cuda(ns, list(range(prefix, 2 * prefix)), hashes), PREFIX_ROUND_FACTOR * rounds)
        result["prefix_blocks"] = prefix
        result["prefix_load_ms"] = load_s * 1000
    return result


def daemon_gpu_mib(free_before: int) -> float:
    """The GPU memory still missing once this process's KV caches are gone: the daemon's. A cache the
    daemon unmapped after we dropped it comes back only when we collect it (torch's IPC bookkeeping),
    and the daemon unmaps when it notices the session end: collect until nothing more comes back."""
    previous, deadline = None, time.monotonic() + 10
    while True:
        torch.cuda.synchronize()
        torch.cuda.ipc_collect()
        torch.cuda.empty_cache()
        used = (free_before - torch.cuda.mem_get_info()[0]) / 2**20
        if used == previous or time.monotonic() > deadline:
            return used
        previous = used
        time.sleep(0.5)


def main() -> None:
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 10
    torch.cuda.init()
    h2d = 2**30 / memcpy_seconds(2**30, True, rounds) / 1e9
    d2h = 2**30 / memcpy_seconds(2**30, False, rounds) / 1e9
    prefix_bytes = -(-PREFIX_BYTES // LLAMA3_8B.block_bytes) * LLAMA3_8B.block_bytes
    prefix_memcpy_ms = memcpy_seconds(prefix_bytes, True, rounds) * 1000
    torch.cuda.empty_cache()
    free_before = torch.cuda.mem_get_info()[0]
    daemon = start_daemon("--pool-size", "12GiB", "--log-level", "warning")
    try:
        layouts = {layout: through_daemon(daemon.address, layout, rounds) for layout in ("LBHNC", "BLHNC")}
        daemon_mib = daemon_gpu_mib(free_before)
    finally:
        stop_daemon(daemon)
    big = [n for n in BATCHES if n >= 64]
    store_ratio = min(layouts[lay]["store_sustained_GBps"][n] for lay in layouts for n in big) / d2h
    load_ratio = min(layouts[lay]["load_sustained_GBps"][n] for lay in layouts for n in big) / h2d
    call_store_ratio = min(layouts[lay]["store_GBps"][n] for lay in layouts for n in big) / d2h
    call_load_ratio = min(layouts[lay]["load_GBps"][n] for lay in layouts for n in big) / h2d
    result = {
        "device": torch.cuda.get_device_name(),
        "geometry": "Llama-3-8B-like: 32 layers x 8 KV heads x head 128 x 16 tokens, bf16 = 2 MiB per block",
        "rounds": rounds,
        "memcpy_h2d_GBps": h2d,
        "memcpy_d2h_GBps": d2h,
        "store_GBps_512": min(layouts[lay]["store_sustained_GBps"][512] for lay in layouts),
        "load_GBps_512": min(layouts[lay]["load_sustained_GBps"][512] for lay in layouts),
        "store_ratio": store_ratio,
        "load_ratio": load_ratio,
        "ratio_note": f"sustained ({CALLERS} calls in flight, median of {WINDOWS} runs of {rounds} calls each), worst of "
        "both layouts over batches of 64 and 512 blocks; store vs d2h memcpy, load vs h2d",
        "single_call_store_ratio": call_store_ratio,
        "single_call_load_ratio": call_load_ratio,
        "single_call_note": "one call at a time, call to answer (RPC, pinning, copy, checksums, commit or release)",
        "prefix_170MB_load_ms": max(layouts[lay]["prefix_load_ms"] for lay in layouts),
        "prefix_170MB_memcpy_ms": prefix_memcpy_ms,
        "prefix_load_vs_memcpy": max(layouts[lay]["prefix_load_ms"] for lay in layouts) / prefix_memcpy_ms,
        "daemon_gpu_memory_mib": daemon_mib,
        "copy_paths": "stores: one Triton kernel launch per call (copy + checksum), the kernel working out every "
        "segment's addresses from the block ids and pool pages; loads from consecutive pool pages: the copy engines, "
        "in chunks each checksummed in HBM while the next moves (blocks that all follow each other on both sides, as "
        "in this benchmark: one cuMemcpyAsync a chunk into BLHNC, three shrinking chunks; one 2-D copy per layer a "
        "chunk into LBHNC, all in one cuMemcpy3DBatchAsync, chunks of 64 or more blocks; other BLHNC loads: runs of "
        "whole blocks, cuMemcpyBatchAsync); other loads: the kernel. The daemon's event loop polls each copy from shortly before "
        "it can have ended",
        "layouts": layouts,
    }
    command = "python bench/transfer_gpu.py" + (f" --rounds {rounds}" if rounds != 10 else "")
    path = write_result("transfer_gpu", result, command)
    plot(result, RESULTS / "transfer_gpu.png")
    for key, value in result.items():
        print(f"{key}: {value}")
    print(f"wrote {path}")


def plot(result: dict, path) -> None:
    plt = pyplot()
    if plt is None:
        return

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for layout, data in result["layouts"].items():
        for kind, style in (("store", "-o"), ("load", "--s")):
            values = [data[f"{kind}_GBps"][n] for n in BATCHES]
            ax.plot(BATCHES, values, style, label=f"{kind} {layout}, one call at a time")
            big = list(data[f"{kind}_sustained_GBps"])
            sustained = [data[f"{kind}_sustained_GBps"][n] for n in big]
            ax.plot(big, sustained, style[-1], markersize=9, label=f"{kind} {layout}, {CALLERS} in flight")
    ax.axhline(result["memcpy_h2d_GBps"], color="gray", linestyle=":", label="pinned memcpy h2d")
    ax.axhline(result["memcpy_d2h_GBps"], color="black", linestyle=":", label="pinned memcpy d2h")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("blocks per call (2 MiB each)")
    ax.set_ylabel("GB/s (call to answer)")
    ax.set_title(f"kvtierd cuda_ipc on {result['device']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
