"""Namespaces retired to make room (--max-namespaces): the least recently used one that no connected
engine has registered and nothing holds goes, with its blocks in the pool (those on disk stay); a session
leaves a namespace by naming it in RegisterRequest.replaces (the connector after a prefix cache
reset). Real daemons with their filesystem tier, real gRPC."""

from __future__ import annotations

import re
import time
import urllib.request

import grpc
import pytest
from blocks import chain_hashes, contents, spec
from test_fs_tier import BLOCK, fs_stats

from kvtier.client import KVTierClient


def stored(client: KVTierClient, model: str, count: int):
    """Register `model`'s namespace in the client's session and store `count` blocks in it."""
    ns = client.register(spec(block_bytes=BLOCK, model_id=model))
    hashes = chain_hashes(model, count)
    client.store(ns, hashes, contents(hashes, BLOCK))
    return ns


def namespaces(daemon) -> dict[str, int]:
    """model id -> blocks in the pool, of the namespaces the daemon keeps."""
    return {n.spec.model_id: n.blocks for n in daemon.admin("ListNamespaces").namespaces}


def metric(daemon, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{daemon.admin('GetInfo').metrics_port}/metrics").read().decode()
    return float(re.search(rf"^{name} (\S+)$", text, re.MULTILINE).group(1))


def on_disk(daemon, blocks: int, timeout: float = 20.0) -> None:
    """Wait until the filesystem tier holds exactly `blocks` blocks (writes and removals are asynchronous)."""
    deadline = time.monotonic() + timeout
    while (held := fs_stats(daemon).blocks) != blocks:
        assert time.monotonic() < deadline, f"{held} blocks on disk, not {blocks}"
        time.sleep(0.02)


def test_a_new_namespace_retires_the_least_recently_used_one_no_engine_has(fs_daemons):
    daemon = fs_daemons("--max-namespaces", "3", "--fs-write-through", "true")
    with KVTierClient(daemon.address) as gone:
        stored(gone, "a", 3)
        stored(gone, "b", 2)
    with KVTierClient(daemon.address) as later:  # "a" used after "b": "b" is the least recently used
        assert later.lookup(later.register(spec(block_bytes=BLOCK, model_id="a")), chain_hashes("a", 3)).hit_count == 3
    with KVTierClient(daemon.address) as engine:
        c = stored(engine, "c", 1)
        on_disk(daemon, 3 + 2 + 1)
        stores_before = metric(daemon, 'kvtierd_stored_blocks_total{tier="ram"}')
        d = stored(engine, "d", 1)  # the limit reached: "b" goes, with its blocks in the pool
        assert namespaces(daemon) == {"a": 3, "c": 1, "d": 1}
        assert daemon.admin("GetStats").pool_used_bytes == 5 * BLOCK
        assert metric(daemon, "kvtierd_retired_namespaces_total") == 1
        assert metric(daemon, 'kvtierd_stored_blocks_total{tier="ram"}') == stores_before + 1  # (counters only go up)
        e = stored(engine, "e", 1)  # then "a", no engine's either
        assert namespaces(daemon) == {"c": 1, "d": 1, "e": 1}
        with pytest.raises(grpc.RpcError) as refused:  # every namespace left is the engine's
            engine.register(spec(block_bytes=BLOCK, model_id="f"))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        f = engine.register(spec(block_bytes=BLOCK, model_id="f"), replaces=c.id)  # the engine leaves "c"
        assert namespaces(daemon) == {"d": 1, "e": 1, "f": 0}
        (mine,) = daemon.admin("ListEngines").engines
        assert sorted(mine.namespaces) == sorted([d.id, e.id, f.id])
    on_disk(daemon, 3 + 2 + 1 + 1 + 1)  # the retired namespaces' blocks stay on disk, until evicted there
    with KVTierClient(daemon.address) as back:  # "b" again (in place of "d", no engine's now): found on disk
        assert back.lookup(back.register(spec(block_bytes=BLOCK, model_id="b")), chain_hashes("b", 2)).hit_count == 2
    assert namespaces(daemon) == {"b": 0, "e": 1, "f": 0}


def test_a_namespace_still_held_is_not_retired(fs_daemons):
    """A lease (or reservation) of a namespace its engine left keeps it until released."""
    daemon = fs_daemons("--max-namespaces", "2")
    with KVTierClient(daemon.address) as engine, KVTierClient(daemon.address) as other:
        a = stored(engine, "a", 2)
        lease = engine.lookup(a, chain_hashes("a", 2), pin=True)
        engine.register(spec(block_bytes=BLOCK, model_id="b"), replaces=a.id)
        with pytest.raises(grpc.RpcError) as refused:
            other.register(spec(block_bytes=BLOCK, model_id="c"))
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert namespaces(daemon) == {"a": 2, "b": 0}
        engine.release(lease.lease_id)
        other.register(spec(block_bytes=BLOCK, model_id="c"))
        assert namespaces(daemon) == {"b": 0, "c": 0}
