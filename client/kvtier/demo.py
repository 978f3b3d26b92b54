"""`make demo` (until the vLLM connector lands): start kvtierd, let engine A store a prompt prefix,
let engine B find and load it, verify the bytes and print `kvtierctl stats`."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtier import ctl
from kvtier.client import KVTierClient
from kvtier.v1 import kvtier_pb2 as pb

BLOCKS = 64
# Llama-3-8B-like geometry: 32 layers x K/V x 8 heads x 16 tokens x 128 dims x bf16 = 2 MiB per block
SPEC = pb.NamespaceSpec(
    model_id="demo/llama-3-8b-like",
    tokens_per_block=16,
    kv_dtype="bfloat16",
    layout="demo",
    num_layers=32,
    num_kv_heads=8,
    head_size=128,
    block_bytes=32 * 2 * 8 * 16 * 128 * 2,
    tp_size=1,
    hash_algorithm="sha256",
    hash_seed="demo",
    hash_bytes=32,
)


def start_daemon(directory: Path) -> subprocess.Popen:
    socket = directory / "kvtierd.sock"
    command = [sys.executable, "-m", "kvtierd", "--socket", str(socket), "--pool-size", "512MiB", "--metrics-port", "0"]
    process = subprocess.Popen(command, stderr=open(directory / "kvtierd.log", "w"))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with grpc.insecure_channel(f"unix://{socket}") as channel:
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
            return process
        except grpc.RpcError:
            time.sleep(0.1)
    process.kill()
    raise SystemExit("kvtierd did not start; see " + str(directory / "kvtierd.log"))


def prefix_hashes(prompt: str, count: int) -> list[bytes]:
    hashes, parent = [], b"demo"
    for i in range(count):
        parent = hashlib.sha256(parent + f"{prompt}:{i}".encode()).digest()
        hashes.append(parent)
    return hashes


def main() -> None:
    directory = Path(tempfile.mkdtemp(prefix="kvtierd-demo-"))
    address = f"unix://{directory}/kvtierd.sock"
    print(f"starting kvtierd on {address}")
    daemon = start_daemon(directory)
    try:
        hashes = prefix_hashes("You are a helpful assistant. " * 40, BLOCKS)
        kv = np.random.default_rng(0).integers(0, 256, (BLOCKS, SPEC.block_bytes), dtype=np.uint8)
        with KVTierClient(address, engine_name="engine-A") as a:
            ns = a.register(SPEC)
            started = time.perf_counter()
            stored = a.store(ns, hashes, kv)
            elapsed = time.perf_counter() - started
            print(f"engine A: stored {stored} blocks ({stored * SPEC.block_bytes >> 20} MiB) in {elapsed * 1000:.1f} ms")
        with KVTierClient(address, engine_name="engine-B") as b:
            ns = b.register(SPEC)
            probe = hashes + prefix_hashes("a question only B asks", 8)
            started = time.perf_counter()
            hit = b.lookup(ns, probe).hit_count
            loaded = b.load(ns, probe)
            elapsed = time.perf_counter() - started
            same = np.array_equal(loaded, kv)
            print(
                f"engine B: HIT {hit} of {len(probe)} blocks from engine A's prefix, loaded "
                f"{loaded.nbytes >> 20} MiB in {elapsed * 1000:.1f} ms, bytes identical: {same}"
            )
        print("\n$ kvtierctl stats")
        ctl.main(["--address", address, "stats"])
        if not same or hit != BLOCKS:
            raise SystemExit("demo failed: engine B did not get engine A's prefix back intact")
    finally:
        daemon.terminate()
        daemon.wait(timeout=30)
        print(f"\nkvtierd stopped (exit code {daemon.returncode}); its log is in {directory}/kvtierd.log")


if __name__ == "__main__":
    main()
