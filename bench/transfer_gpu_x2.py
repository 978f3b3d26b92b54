"""Two GPUs busy at once through one kvtierd (TRANSPORT_CUDA_IPC), against two raw memcpy streams, in one run.

On a machine with two CUDA devices: raw pinned host<->device memcpy on both GPUs at the same time
(the host's PCIe and memory limit), then store and load through one real kvtierd with both GPUs
busy: one KV cache per GPU, as the two ranks of a TP=2 engine (each registers its own device by
UUID; the ranks share one namespace, each under keys of its own rank), CALLERS calls in flight per
GPU, batches of 64 and 512 blocks of the Llama-3-8B-like layout in the block-outermost layout
(BLHNC) the connector asks vLLM for. Aggregate GB/s = all bytes moved on both GPUs / wall time.
This process plays the engine. Writes bench/results/transfer_gpu_x2.json. Usage: python bench/transfer_gpu_x2.py [--rounds N]
"""

from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from common import start_daemon, stop_daemon, write_result  # isort: skip
from fake_engine import allocate_kv_cache, block_hashes, namespace_spec  # noqa: E402
from transfer_gpu import CALLERS, LLAMA3_8B  # noqa: E402

from kvtier.client import KVTierClient  # noqa: E402
from kvtier.engine.gpu_kv import GpuKV  # noqa: E402
from kvtier.engine.rank_keys import keyed, rank_suffix  # noqa: E402

GPUS = 2
BATCHES = [64, 512]
LAYOUT = "BLHNC"


def on_all_gpus(work) -> float:
    """Run work(gpu) on one thread per GPU at the same time; the wall seconds until all ended."""
    start = threading.Barrier(GPUS + 1)
    errors: list[BaseException] = []

    def run(gpu: int) -> None:
        torch.cuda.set_device(gpu)
        start.wait()
        try:
            work(gpu)
        except BaseException as exc:  # noqa: BLE001 (raised again in the caller's thread)
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(gpu,)) for gpu in range(GPUS)]
    for thread in threads:
        thread.start()
    started = time.perf_counter()
    start.wait()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - started


def memcpy_aggregate_GBps(to_device: bool, rounds: int) -> float:
    nbytes = 2**30
    pairs = []
    for gpu in range(GPUS):
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        device = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{gpu}")
        pairs.append((host, device) if to_device else (device, host))

    def copy(gpu: int, times: int) -> None:
        src, dst = pairs[gpu]
        stream = torch.cuda.Stream(gpu)
        with torch.cuda.stream(stream):
            for _ in range(times):
                dst.copy_(src, non_blocking=True)
        stream.synchronize()

    on_all_gpus(lambda gpu: copy(gpu, 1))  # warm-up
    return GPUS * rounds * nbytes / on_all_gpus(lambda gpu: copy(gpu, rounds)) / 1e9


class Rank:
    """One TP rank's KV cache on its GPU, registered with the daemon through its own session."""

    def __init__(self, address: str, gpu: int) -> None:
        torch.cuda.set_device(gpu)
        g = LLAMA3_8B
        _, views = allocate_kv_cache(g, LAYOUT, device=f"cuda:{gpu}")
        self.kv = GpuKV(list(views.values()), g.num_blocks)
        self.client = KVTierClient(address, engine_name=f"bench-x2-rank{gpu}", timeout=60).connect()
        spec = namespace_spec(g, LAYOUT, tp_size=GPUS)
        self.suffix = rank_suffix(spec, gpu)
        self.ns = self.client.register(spec, self.kv.describe())
        assert self.ns.cuda_registration, self.ns.cuda_refused
        self.ready = self.kv.record_ready()  # (nothing writes the blocks: every store names this event)


def sustained_aggregate_GBps(ranks: list[Rank], call, n: int, rounds: int) -> float:
    """CALLERS threads per GPU each issue `rounds` calls call(rank, caller) back to back."""

    def work(gpu: int) -> None:
        with ThreadPoolExecutor(CALLERS) as pool:
            list(pool.map(lambda caller: [call(ranks[gpu], caller) for _ in range(rounds)], range(CALLERS)))

    on_all_gpus(lambda gpu: [call(ranks[gpu], caller) for caller in range(CALLERS)])  # warm-up
    return GPUS * CALLERS * rounds * n * LLAMA3_8B.block_bytes / on_all_gpus(work) / 1e9


def through_daemon(address: str, rounds: int) -> dict:
    ranks = [Rank(address, gpu) for gpu in range(GPUS)]
    result = {"store_GBps": {}, "load_GBps": {}}
    try:
        for n in BATCHES:
            stored = block_hashes(-n, n)
            for rank in ranks:
                assert rank.client.store_cuda(rank.ns, keyed(stored, rank.suffix), list(range(n)), rank.ready) == n

            def load(rank: Rank, caller: int, n=n, hashes=stored) -> None:
                assert rank.client.load_cuda(rank.ns, list(range(caller * n, (caller + 1) * n)), keyed(hashes, rank.suffix)) == n

            # hashes for every store (warm-up included), made before the clock starts (an engine has its
            # hashes from vLLM); a list iterator's next holds the GIL, so the callers may share it
            batches = iter([block_hashes(1000 * n + call, n) for call in range(GPUS * CALLERS * (rounds + 1))])

            def store(rank: Rank, caller: int, n=n, batches=batches) -> None:
                keys = keyed(next(batches), rank.suffix)
                assert rank.client.store_cuda(rank.ns, keys, list(range(caller * n, (caller + 1) * n)), rank.ready) == n

            result["load_GBps"][n] = sustained_aggregate_GBps(ranks, load, n, rounds)  # before stores evict them
            result["store_GBps"][n] = sustained_aggregate_GBps(ranks, store, n, rounds)
    finally:
        for rank in ranks:
            rank.client.close()
    return result


def main() -> None:
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 10
    if torch.cuda.device_count() < GPUS:
        sys.exit(f"needs {GPUS} CUDA devices, found {torch.cuda.device_count()}")
    h2d = memcpy_aggregate_GBps(True, rounds)
    d2h = memcpy_aggregate_GBps(False, rounds)
    torch.cuda.empty_cache()
    daemon = start_daemon("--pool-size", "12GiB", "--log-level", "warning")
    try:
        measured = through_daemon(daemon.address, rounds)
    except BaseException:
        print(daemon.log()[-6000:])
        raise
    finally:
        stop_daemon(daemon)
    result = {
        "devices": [torch.cuda.get_device_name(gpu) for gpu in range(GPUS)],
        "geometry": "Llama-3-8B-like: 32 layers x 8 KV heads x head 128 x 16 tokens, bf16 = 2 MiB per block, BLHNC",
        "rounds": rounds,
        "calls_in_flight_per_gpu": CALLERS,
        "memcpy_h2d_GBps_aggregate": h2d,
        "memcpy_d2h_GBps_aggregate": d2h,
        "store_GBps_aggregate": measured["store_GBps"],
        "load_GBps_aggregate": measured["load_GBps"],
        "store_ratio": min(measured["store_GBps"].values()) / d2h,
        "load_ratio": min(measured["load_GBps"].values()) / h2d,
        "ratio_note": "worst over batches of 64 and 512 blocks; store vs the two d2h memcpy streams, load vs h2d",
    }
    command = "python bench/transfer_gpu_x2.py" + (f" --rounds {rounds}" if rounds != 10 else "")
    path = write_result("transfer_gpu_x2", result, command)
    for key, value in result.items():
        print(f"{key}: {value}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
