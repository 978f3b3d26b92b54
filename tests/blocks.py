"""Test data: block hashes and block contents that any process can recompute from the hash."""

from __future__ import annotations

import hashlib

import numpy as np

from kvtier.v1 import kvtier_pb2 as pb

HASH_BYTES = 32


def chain_hashes(seed: str, count: int) -> list[bytes]:
    """A prefix chain like vLLM's: each hash depends on the previous one."""
    hashes, parent = [], seed.encode()
    for i in range(count):
        parent = hashlib.sha256(parent + i.to_bytes(4, "little")).digest()
        hashes.append(parent)
    return hashes


def block_content(block_hash: bytes, block_bytes: int) -> np.ndarray:
    rng = np.random.default_rng(int.from_bytes(block_hash[:8], "little"))
    return rng.integers(0, 256, block_bytes, dtype=np.uint8)


def contents(hashes: list[bytes], block_bytes: int) -> np.ndarray:
    return np.stack([block_content(h, block_bytes) for h in hashes]) if hashes else np.empty((0, block_bytes), np.uint8)


def spec(block_bytes: int = 96 * 1024, model_id: str = "test-model", **overrides) -> pb.NamespaceSpec:
    fields = dict(
        model_id=model_id,
        tokens_per_block=16,
        kv_dtype="bfloat16",
        layout="test",
        num_layers=4,
        num_kv_heads=2,
        head_size=64,
        block_bytes=block_bytes,
        tp_size=1,
        tp_rank=0,
        hash_algorithm="sha256",
        hash_seed="test",
        hash_bytes=HASH_BYTES,
    )
    fields.update(overrides)
    return pb.NamespaceSpec(**fields)
