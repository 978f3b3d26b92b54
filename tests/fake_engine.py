"""A fake GPU engine for the CUDA IPC tests and benchmark: torch only, no vLLM.

It allocates its KV cache exactly as vLLM 0.33 does (one int8 buffer on the GPU, per-layer
`[num_blocks, heads, block_size, 2 * head_size]` views in the layer-major LBHNC or the
block-outermost BLHNC layout), fills blocks with data derived from a seed, and drives the worker code
the vLLM connector uses (kvtier.engine: DaemonLink, BlockTransfers with a GpuKV).

As a process: `python fake_engine.py SPEC_JSON`, where the spec holds the daemon address, the cache
geometry, the GPU index ("device", default 0) and a list of steps:
  {"fill": [block ids], "seed": s}       write seeded data into those blocks
  {"store": [block ids], "seed": s}      store them under hashes derived from s, or from "hash_seed"
                                         when given (waits for the daemon)
  {"load": [block ids], "seed": s}       load the blocks stored under seed s (or "hash_seed") into these ids
  {"check": [block ids], "seed": s}      compare them with the seeded data
  {"wait_for": path}                     wait until the file exists
  {"store_forever": [block ids]}         store fresh hashes in a loop (to be killed mid-store)
It prints one JSON line per step ("STEP {...}") and "DONE" at the end.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass

import pytest
import torch

from kvtier.engine.gpu_kv import GpuKV
from kvtier.engine.jobs import LoadJob, StoreJob
from kvtier.engine.link import DaemonLink
from kvtier.engine.rank_keys import key_bytes
from kvtier.engine.worker import BlockTransfers
from kvtier.v1 import kvtier_pb2 as pb


def gpu(test):
    """The `gpu` marker, and a clean skip without CUDA."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")(test))


@dataclass(frozen=True)
class Geometry:
    layers: int = 4
    heads: int = 8
    block_size: int = 16
    head_size: int = 128
    num_blocks: int = 64
    dtype: str = "bfloat16"

    @property
    def page_bytes(self) -> int:
        return (
            self.heads * self.block_size * 2 * self.head_size * torch.tensor([], dtype=getattr(torch, self.dtype)).element_size()
        )

    @property
    def block_bytes(self) -> int:
        return self.page_bytes * self.layers


def allocate_kv_cache(geometry: Geometry, layout: str, device: str = "cuda") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """vLLM 0.33's allocation: one int8 buffer and a strided per-layer view into it."""
    g = geometry
    dtype = getattr(torch, g.dtype)
    buffer = torch.zeros(g.num_blocks * g.block_bytes, dtype=torch.int8, device=device)
    typed = buffer.view(dtype)
    elem = typed.element_size()
    page = g.page_bytes // elem
    shape = (g.num_blocks, g.heads, g.block_size, 2 * g.head_size)
    inner = (g.block_size * 2 * g.head_size, 2 * g.head_size, 1)
    views = {}
    for layer in range(g.layers):
        if layout == "LBHNC":
            offset, block_stride = layer * g.num_blocks * page, page
        elif layout == "BLHNC":
            offset, block_stride = layer * page, g.layers * page
        else:
            raise ValueError(f"unknown layout {layout}")
        views[f"model.layers.{layer}.self_attn"] = torch.as_strided(typed, shape, (block_stride, *inner), offset)
    return buffer, views


def seeded_blocks(geometry: Geometry, seed: int, count: int, device: str = "cuda") -> torch.Tensor:
    """[count, block_bytes] uint8: the bytes block i of `seed` holds (same on every process)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    return torch.randint(0, 256, (count, geometry.block_bytes), dtype=torch.uint8, device=device, generator=generator)


def block_hashes(seed: int, count: int) -> list[bytes]:
    return [hashlib.sha256(f"{seed}:{i}".encode()).digest() for i in range(count)]


def namespace_spec(geometry: Geometry, layout: str, tp_size: int = 1) -> pb.NamespaceSpec:
    return pb.NamespaceSpec(
        model_id="fake-llama",
        tokens_per_block=geometry.block_size,
        kv_dtype=geometry.dtype,
        layout=f"vllm-layer-major-blocks:{layout}",
        num_layers=geometry.layers,
        num_kv_heads=geometry.heads,
        head_size=geometry.head_size,
        block_bytes=geometry.block_bytes,
        chunk_bytes=[geometry.page_bytes] * geometry.layers,
        hash_algorithm="sha256",
        hash_bytes=key_bytes(32, tp_size),
        tp_size=tp_size,
    )


class FakeEngine:
    def __init__(
        self, address: str, geometry: Geometry, layout: str, name: str = "fake-engine", tp_rank: int = 0, tp_size: int = 1
    ) -> None:
        """One worker of an engine; a TP engine is `tp_size` of these, each registering its own rank."""
        self.geometry = geometry
        self.buffer, self.views = allocate_kv_cache(geometry, layout)
        self.kv = GpuKV(list(self.views.values()), geometry.num_blocks)
        self.link = DaemonLink(address, name, timeout=30.0, reconnect_interval=0.2)
        self.transfers = BlockTransfers(self.link, self.kv, tp_rank=tp_rank)
        self.transfers.configure(namespace_spec(geometry, layout, tp_size).SerializeToString())
        self.barrier()  # connected and registered (the connector's first stores may go through shm instead)

    def blocks(self, block_ids: list[int]) -> torch.Tensor:
        """The bytes of these blocks as the pool stores them: [n, block_bytes] uint8."""
        return torch.cat([r.rows[block_ids] for r in self.kv.runs], dim=1)

    def fill(self, block_ids: list[int], seed: int, busy: bool = True) -> None:
        """Write seeded data into the blocks as a forward would: queued on the compute stream (behind
        ~0.1 s of GPU work when `busy`), not waited for. Only the ready event orders a store's copy
        after it."""
        data = seeded_blocks(self.geometry, seed, len(block_ids))
        if busy:
            torch.cuda._sleep(200_000_000)
        start = 0
        for run in self.kv.runs:
            run.rows[block_ids] = data[:, start : start + run.run.size]
            start += run.run.size

    def store(self, block_ids: list[int], hash_seed: int, req_id: str = "req") -> None:
        """As the connector does after a forward: save, then (here) wait for the daemon's copy."""
        self.transfers.save([StoreJob(req_id, block_ids, block_hashes(hash_seed, len(block_ids)))])
        self.barrier()

    def store_and_overwrite(self, block_ids: list[int], seed: int, overwrite_seed: int, fence: bool = True) -> None:
        """Store the blocks, then, as vLLM does once it has freed them (the request finished) and
        allocated them afresh to the next step, write them again at once; the connector fences them
        first (`fence`: False only to show what it prevents). The store call is under way by then
        (as after a step's forward), so the fence waits for it rather than withdrawing it."""
        self.transfers.save([StoreJob("finished", block_ids, block_hashes(seed, len(block_ids)))])
        sent = self.transfers._gpu_stores[-1].future
        while not (sent.running() or sent.done()):
            time.sleep(0.0005)
        if fence:
            self.transfers.fence(set(block_ids))
        self.fill(block_ids, overwrite_seed, busy=False)
        self.barrier()

    def barrier(self) -> None:
        """Every call submitted to the link so far has finished."""
        self.link.submit(lambda client, ns: None).result(timeout=60)

    def load(self, block_ids: list[int], hash_seed: int, req_id: str = "load") -> bool:
        self.transfers.start_loads([LoadJob(req_id, block_ids, block_hashes(hash_seed, len(block_ids)))])
        while True:
            finished, failed = self.transfers.finished_loads()
            if req_id in finished:
                return req_id not in failed
            time.sleep(0.0005)

    def matches(self, block_ids: list[int], seed: int) -> bool:
        return torch.equal(self.blocks(block_ids), seeded_blocks(self.geometry, seed, len(block_ids)))


def main(spec: dict) -> None:
    torch.cuda.set_device(spec.get("device", 0))  # a TP rank's GPU (the daemon finds it by UUID)
    engine = FakeEngine(
        spec["address"],
        Geometry(**spec.get("geometry", {})),
        spec.get("layout", "LBHNC"),
        spec.get("name", "fake"),
        spec.get("tp_rank", 0),
        spec.get("tp_size", 1),
    )
    print(f"READY pid={os.getpid()}", flush=True)
    for step in spec["steps"]:
        result: dict = {"step": step}
        if "fill" in step:
            engine.fill(step["fill"], step["seed"])
        elif "store" in step:
            engine.store(step["store"], step.get("hash_seed", step["seed"]))
            result["cuda_ipc"] = engine.link.cuda_registered
            result["stored_blocks"] = engine.transfers.take_stats().stored_blocks
        elif "store_and_overwrite" in step:
            engine.store_and_overwrite(step["store_and_overwrite"], step["seed"], step["overwrite_seed"], step.get("fence", True))
            result["stored_blocks"] = engine.transfers.take_stats().stored_blocks
        elif "load" in step:
            result["loaded"] = engine.load(step["load"], step.get("hash_seed", step["seed"]))
            result["cuda_ipc"] = engine.link.cuda_registered
        elif "check" in step:
            result["matches"] = engine.matches(step["check"], step["seed"])
        elif "wait_for" in step:
            while not os.path.exists(step["wait_for"]):
                time.sleep(0.05)
        elif "store_forever" in step:
            for seed in range(1_000_000):
                engine.store(step["store_forever"], 10_000 + seed, f"r{seed}")
                if seed == 3:
                    print("STORING", flush=True)
        print("STEP " + json.dumps(result), flush=True)
    print("DONE", flush=True)
    engine.link.close()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
