"""Prometheus metrics. Tier and pool figures are read from the live index at scrape time (one source
of truth); RPC latencies and errors are recorded as calls happen."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from kvtierd.block_store import RAM_TIER, BlockStore
from kvtierd.sessions import SessionRegistry

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)


class IndexCollector:
    def __init__(self, store: BlockStore, sessions: SessionRegistry) -> None:
        self._store = store
        self._sessions = sessions

    def collect(self):
        store = self._store
        namespaces = list(store.namespaces.values())

        def tier_counter(name: str, doc: str, value: int) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=["tier"])
            family.add_metric([RAM_TIER], value)
            return family

        def total(attr: str) -> int:
            return sum(getattr(ns.counters, attr) for ns in namespaces)

        def total_bytes(attr: str) -> int:
            return sum(getattr(ns.counters, attr) * ns.block_bytes for ns in namespaces)

        yield CounterMetricFamily("kvtierd_lookup_requests", "Lookup calls served.", value=total("lookups"))
        yield tier_counter("kvtierd_hit_blocks", "Blocks found by lookups (leading prefix).", total("hits"))
        yield tier_counter("kvtierd_miss_blocks", "Blocks asked for by lookups and not found.", total("misses"))
        yield tier_counter("kvtierd_stored_blocks", "Blocks committed.", total("stored_blocks"))
        yield tier_counter("kvtierd_stored_bytes", "Bytes committed.", total_bytes("stored_blocks"))
        yield tier_counter("kvtierd_loaded_blocks", "Blocks handed out for loads.", total("loaded_blocks"))
        yield tier_counter("kvtierd_loaded_bytes", "Bytes handed out for loads.", total_bytes("loaded_blocks"))
        yield tier_counter("kvtierd_evicted_blocks", "Blocks evicted to make room.", total("evictions"))
        yield CounterMetricFamily(
            "kvtierd_not_admitted_blocks", "Store offers refused by --store-threshold.", value=total("not_admitted")
        )
        usage = store.usage()
        used = GaugeMetricFamily("kvtierd_tier_used_bytes", "Bytes of the tier in use (pages held).", labels=["tier"])
        used.add_metric([RAM_TIER], usage.used_pages * store.page_size)
        yield used
        capacity = GaugeMetricFamily("kvtierd_tier_capacity_bytes", "Capacity of the tier.", labels=["tier"])
        capacity.add_metric([RAM_TIER], store.capacity_bytes)
        yield capacity
        blocks = GaugeMetricFamily("kvtierd_tier_blocks", "Committed blocks in the tier.", labels=["tier"])
        blocks.add_metric([RAM_TIER], sum(len(ns.blocks) for ns in namespaces))
        yield blocks
        yield GaugeMetricFamily(
            "kvtierd_reserved_bytes", "Pool bytes held by open reservations.", value=usage.reserved_pages * store.page_size
        )
        yield GaugeMetricFamily("kvtierd_pinned_blocks", "Blocks pinned by open leases.", value=usage.pinned_blocks)
        yield GaugeMetricFamily("kvtierd_namespaces", "Namespaces known.", value=len(namespaces))
        yield GaugeMetricFamily("kvtierd_engines_connected", "Engine sessions open.", value=len(self._sessions))


class Metrics:
    def __init__(self, store: BlockStore, sessions: SessionRegistry) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(IndexCollector(store, sessions))
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
        self.cuda_checksum_failures = Counter(
            "kvtierd_cuda_checksum_failures", "Blocks whose cuda_ipc load failed its checksum.", registry=self.registry
        )
