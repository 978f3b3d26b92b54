"""Prometheus metrics. Tier and pool figures are read from the live index at scrape time (one source
of truth); RPC latencies and errors are recorded as calls happen."""

from __future__ import annotations

from dataclasses import replace

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvtierd.block_store import RAM_TIER, BlockStore
from kvtierd.fs_index import FsCounters
from kvtierd.fs_tier import FS_TIER, FsTier
from kvtierd.sessions import SessionRegistry

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)


class IndexCollector:
    def __init__(self, store: BlockStore, sessions: SessionRegistry, fs: FsTier | None) -> None:
        self._store = store
        self._sessions = sessions
        self._fs = fs

    def collect(self):
        store = self._store
        with store.census:  # (a retirement moves a namespace's counters into the retired totals at once)
            namespaces = list(store.namespaces.values())
            ram, ram_bytes = replace(store.retired), replace(store.retired_bytes)
            for ns in namespaces:
                ram.add(ns.counters)
                ram_bytes.add(ns.counters, ns.block_bytes)
        fs_counters, fs_blocks, _ = self._fs.totals(None) if self._fs is not None else (None, 0, 0)
        fs_bytes = FsCounters() if self._fs is not None else None
        if fs_bytes is not None:  # (every namespace the tier has counted, retired ones included)
            for digest, block_bytes in list(self._fs.index.block_bytes.items()):
                fs_bytes.add(self._fs.index.counters.get(digest, FsCounters()), block_bytes)

        def per_tier(family, ram: float, fs: float | None = None):
            family.add_metric([RAM_TIER], ram)
            if self._fs is not None and fs is not None:
                family.add_metric([FS_TIER], fs)
            return family

        def tier_counter(name: str, doc: str, attr: str, fs_attr: str | None = None) -> CounterMetricFamily:
            fs = getattr(fs_counters, fs_attr or attr) if fs_counters is not None else None
            return per_tier(CounterMetricFamily(name, doc, labels=["tier"]), getattr(ram, attr), fs)

        def tier_bytes(name: str, doc: str, attr: str) -> CounterMetricFamily:
            fs = getattr(fs_bytes, attr) if fs_bytes is not None else None
            return per_tier(CounterMetricFamily(name, doc, labels=["tier"]), getattr(ram_bytes, attr), fs)

        yield CounterMetricFamily(
            "kvtierd_lookup_requests",
            "Lookups served (Lookup calls, LookupBatch queries, Load calls by hashes).",
            value=ram.lookups,
        )
        yield tier_counter("kvtierd_hit_blocks", "Blocks found by lookups (leading prefix).", "hits")
        yield tier_counter("kvtierd_miss_blocks", "Blocks asked for by lookups and not found.", "misses")
        yield tier_counter("kvtierd_stored_blocks", "Blocks committed to the pool or written to disk.", "stored_blocks")
        yield tier_bytes("kvtierd_stored_bytes", "Bytes committed to the pool or written to disk.", "stored_blocks")
        yield tier_counter("kvtierd_loaded_blocks", "Blocks handed out for loads or promoted from disk.", "loaded_blocks")
        yield tier_bytes("kvtierd_loaded_bytes", "Bytes handed out for loads or promoted from disk.", "loaded_blocks")
        yield tier_counter("kvtierd_evicted_blocks", "Blocks evicted to make room.", "evictions")
        yield CounterMetricFamily(
            "kvtierd_not_admitted_blocks",
            "Store offers refused by --store-threshold.",
            value=ram.not_admitted,
        )
        usage = store.usage()
        fs_index = self._fs.index if self._fs is not None else None
        yield per_tier(
            GaugeMetricFamily("kvtierd_tier_used_bytes", "Bytes of the tier in use.", labels=["tier"]),
            usage.used_pages * store.page_size,
            fs_index.used_bytes if fs_index is not None else None,
        )
        yield per_tier(
            GaugeMetricFamily("kvtierd_tier_capacity_bytes", "Capacity of the tier.", labels=["tier"]),
            store.capacity_bytes,
            fs_index.capacity if fs_index is not None else None,
        )
        yield per_tier(
            GaugeMetricFamily("kvtierd_tier_blocks", "Committed blocks in the tier.", labels=["tier"]),
            sum(len(ns.blocks) for ns in namespaces),
            fs_blocks,
        )
        yield GaugeMetricFamily(
            "kvtierd_reserved_bytes", "Pool bytes held by open reservations.", value=usage.reserved_pages * store.page_size
        )
        yield GaugeMetricFamily(
            "kvtierd_pinned_blocks",
            "Blocks pinned by open leases (or held while their prefix is promoted from disk).",
            value=usage.pinned_blocks,
        )
        yield GaugeMetricFamily("kvtierd_namespaces", "Namespaces known.", value=len(namespaces))
        yield GaugeMetricFamily("kvtierd_engines_connected", "Engine sessions open.", value=len(self._sessions))
        if self._fs is not None:
            yield from _fs_metrics(self._fs, fs_counters)


def _fs_metrics(fs: FsTier, counters: FsCounters):
    health = fs.health
    yield CounterMetricFamily(
        "kvtierd_fs_checksum_failures",
        "Block files found corrupt or truncated on read (deleted).",
        value=counters.checksum_failures,
    )
    errors = CounterMetricFamily("kvtierd_fs_io_errors", "Failed block file reads and writes.", labels=["op"])
    errors.add_metric(["read"], health.read_errors)
    errors.add_metric(["write"], health.write_errors)
    yield errors
    skipped = CounterMetricFamily("kvtierd_fs_skipped_blocks", "Blocks not written to disk, by reason.", labels=["reason"])
    for reason in ("paused", "queue_full", "tier_full", "no_memory"):
        skipped.add_metric([reason], health.skipped[reason])
    yield skipped
    yield GaugeMetricFamily("kvtierd_fs_stores_paused", "1 while writes to disk are paused after a failure.", value=health.paused)
    yield GaugeMetricFamily(
        "kvtierd_fs_queue_bytes", "Bytes of blocks copied out of the pool and waiting to be written.", value=fs.staging.queued
    )


class Metrics:
    def __init__(self, store: BlockStore, sessions: SessionRegistry, fs: FsTier | None = None) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(IndexCollector(store, sessions, fs))
        self.rpc_duration = Histogram(
            "kvtierd_rpc_duration_seconds",
            "Server-side time of each RPC.",
            ["method"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.rpc_errors = Counter(
            "kvtierd_rpc_errors", "RPCs answered with an error, by gRPC status code.", ["method", "code"], registry=self.registry
        )
        self.cuda_copy_seconds = Histogram(
            "kvtierd_cuda_copy_seconds",
            "Time of one cuda_ipc batch copy (store: engine GPU to pool, load: pool to engine GPU), waits included.",
            ["direction"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.cuda_copy_bytes = Counter(
            "kvtierd_cuda_copy_bytes", "Bytes moved by cuda_ipc copies.", ["direction"], registry=self.registry
        )
        self.retired_namespaces = Counter(
            "kvtierd_retired_namespaces",
            "Namespaces retired with their blocks to make room for a new one (--max-namespaces).",
            registry=self.registry,
        )
        self.cuda_checksum_failures = Counter(
            "kvtierd_cuda_checksum_failures", "Blocks whose cuda_ipc load failed its checksum.", registry=self.registry
        )
