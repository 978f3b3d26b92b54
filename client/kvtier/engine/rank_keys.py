"""Block keys of tensor-parallel ranks: the ranks of a TP engine share one namespace, and each keeps
its own shard of a block under the block's vLLM hash followed by its rank (RANK_KEY_BYTES,
big-endian). A TP=1 engine's keys are its hashes alone. Pipeline stages hold other layers, so each
stage keeps a namespace of its own (`pp_rank` in the spec)."""

from __future__ import annotations

from kvtier.v1 import kvtier_pb2 as pb

RANK_KEY_BYTES = 2


def key_bytes(hash_bytes: int, tp_size: int) -> int:
    """The namespace's hash_bytes: a vLLM hash of `hash_bytes`, and its rank when there are ranks."""
    return hash_bytes + (RANK_KEY_BYTES if tp_size > 1 else 0)


def rank_suffix(spec: pb.NamespaceSpec, tp_rank: int) -> bytes:
    """What follows a block hash in the keys of rank `tp_rank` of the namespace's engine."""
    return tp_rank.to_bytes(RANK_KEY_BYTES, "big") if spec.tp_size > 1 else b""


def keyed(hashes: list[bytes], suffix: bytes) -> list[bytes]:
    """The keys of `hashes` for a rank with this `suffix` (rank_suffix)."""
    return [h + suffix for h in hashes] if suffix else hashes
