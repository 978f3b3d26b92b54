"""Namespaces: the digest of everything that makes two engines' bytes for one block hash interchangeable."""

from __future__ import annotations

import hashlib
import json

from kvtier.messages import message_to_dict
from kvtier.v1 import kvtier_pb2 as pb
from kvtierd.errors import InvalidArgument

# Bump when the meaning of stored bytes changes; old namespaces then never match new ones.
NAMESPACE_FORMAT_VERSION = 1
MAX_HASH_BYTES = 64
MAX_SPEC_BYTES = 8192  # every namespace's spec goes into GetStats and ListNamespaces answers


# Fields added since format version 1 count only when set, so a spec that leaves them out keeps the
# id it had before they existed (and the fs tier keeps its directory).
LATER_FIELDS = ("pp_size", "pp_rank")


def namespace_digest(spec: pb.NamespaceSpec) -> str:
    fields = message_to_dict(spec)
    for name in LATER_FIELDS:
        if not fields[name]:
            del fields[name]
    canonical = {"format_version": NAMESPACE_FORMAT_VERSION, "spec": fields}
    encoded = json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(encoded).hexdigest()[:32]


def validate_spec(spec: pb.NamespaceSpec, pool_size: int) -> None:
    if spec.ByteSize() > MAX_SPEC_BYTES:
        raise InvalidArgument(f"namespace spec: {spec.ByteSize()} bytes, more than the limit of {MAX_SPEC_BYTES}")
    if not spec.model_id:
        raise InvalidArgument("namespace spec: model_id is required")
    if spec.block_bytes == 0 or spec.block_bytes > pool_size // 4:
        raise InvalidArgument(
            f"namespace spec: block_bytes must be in 1..{pool_size // 4} (a quarter of the pool), got {spec.block_bytes}"
        )
    if not 1 <= spec.hash_bytes <= MAX_HASH_BYTES:
        raise InvalidArgument(f"namespace spec: hash_bytes must be in 1..{MAX_HASH_BYTES}, got {spec.hash_bytes}")
    if spec.tokens_per_block == 0:
        raise InvalidArgument("namespace spec: tokens_per_block must be > 0")
    if spec.chunk_bytes and sum(spec.chunk_bytes) != spec.block_bytes:
        raise InvalidArgument(
            f"namespace spec: chunk_bytes add up to {sum(spec.chunk_bytes)}, not block_bytes {spec.block_bytes}"
        )
    if spec.tp_size and spec.tp_rank >= spec.tp_size:
        raise InvalidArgument(f"namespace spec: tp_rank {spec.tp_rank} out of range for tp_size {spec.tp_size}")
    if spec.pp_size and spec.pp_rank >= spec.pp_size:
        raise InvalidArgument(f"namespace spec: pp_rank {spec.pp_rank} out of range for pp_size {spec.pp_size}")
