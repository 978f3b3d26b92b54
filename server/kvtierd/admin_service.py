"""KVTierAdmin: the operator API behind kvtierctl."""

from __future__ import annotations

import logging

import numpy as np
import xxhash

from kvtier import checksum
from kvtier.pool_view import decode_page_ids
from kvtier.v1 import kvtier_pb2 as pb
from kvtier.v1 import kvtier_pb2_grpc as pb_grpc
from kvtierd.block_store import RAM_TIER, Block, BlockStore, Namespace, TierCounters
from kvtierd.errors import InvalidArgument
from kvtierd.metrics import Metrics
from kvtierd.rpc import unary
from kvtierd.sessions import SessionRegistry
from kvtierd.shm_pool import SharedPool

log = logging.getLogger("kvtierd.admin")

DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 10_000


class AdminService(pb_grpc.KVTierAdminServicer):
    def __init__(
        self, store: BlockStore, pool: SharedPool, sessions: SessionRegistry, metrics: Metrics, info: pb.GetInfoResponse
    ) -> None:
        self.store = store
        self.pool = pool
        self.sessions = sessions
        self.metrics = metrics
        self.info = info

    @unary
    def GetInfo(self, request, context) -> pb.GetInfoResponse:  # noqa: N802
        return self.info

    @unary
    def GetStats(self, request: pb.GetStatsRequest, context) -> pb.GetStatsResponse:  # noqa: N802
        store = self.store
        selected = [store.namespace(request.namespace)] if request.namespace else list(store.namespaces.values())
        usage = store.usage()
        totals = TierCounters()
        response = pb.GetStatsResponse(
            reserved_bytes=usage.reserved_pages * store.page_size,
            pinned_blocks=usage.pinned_blocks,
            engines_connected=len(self.sessions),
            pool_used_bytes=usage.used_pages * store.page_size,
        )
        blocks = used = 0
        for ns in selected:
            stats = self._tier_stats(ns.counters, len(ns.blocks), len(ns.blocks) * ns.block_bytes)
            response.namespaces.add(namespace=ns.id, model_id=ns.spec.model_id, tiers=[stats])
            totals.add(ns.counters)
            blocks += len(ns.blocks)
            used += len(ns.blocks) * ns.block_bytes
        response.tiers.append(self._tier_stats(totals, blocks, used))
        return response

    def _tier_stats(self, counters: TierCounters, blocks: int, used: int) -> pb.TierStats:
        asked = counters.hits + counters.misses
        return pb.TierStats(
            tier=RAM_TIER,
            blocks=blocks,
            bytes=used,
            capacity_bytes=self.store.capacity_bytes,
            hits=counters.hits,
            misses=counters.misses,
            hit_ratio=counters.hits / asked if asked else 0.0,
            evictions=counters.evictions,
        )

    @unary
    def ListNamespaces(self, request, context) -> pb.ListNamespacesResponse:  # noqa: N802
        response = pb.ListNamespacesResponse()
        for ns in self.store.namespaces.values():
            response.namespaces.add(
                namespace=ns.id,
                spec=ns.spec,
                blocks=len(ns.blocks),
                bytes=len(ns.blocks) * ns.block_bytes,
                engines=self.sessions.engines_in(ns.id),
                created_at=ns.created_at,
            )
        return response

    @unary
    def ListBlocks(self, request: pb.ListBlocksRequest, context) -> pb.ListBlocksResponse:  # noqa: N802
        ns = self.store.namespace(request.namespace) if request.namespace else None
        page_size = request.page_size or DEFAULT_PAGE_SIZE
        if page_size > MAX_PAGE_SIZE:
            raise InvalidArgument(f"page_size {page_size} exceeds {MAX_PAGE_SIZE}")
        token = request.page_token or "0"
        if not token.isdigit():
            raise InvalidArgument(f"bad page_token {request.page_token!r}")
        offset = int(token)
        store = self.store
        blocks = list(store.committed_blocks(ns))
        slots = np.fromiter((b.slot for b in blocks), dtype=np.int64, count=len(blocks))
        if request.order == pb.BLOCK_ORDER_HITS:
            order = np.lexsort((-store.last_access[slots], -store.hits[slots].astype(np.int64)))
        else:
            order = np.argsort(-store.last_access[slots], kind="stable")
        page = [blocks[i] for i in order[offset : offset + page_size].tolist()]
        response = pb.ListBlocksResponse(blocks=[_block_info(store, b) for b in page], total=len(blocks))
        if offset + page_size < len(blocks):
            response.next_page_token = str(offset + page_size)
        return response

    @unary
    def InspectBlock(self, request: pb.InspectBlockRequest, context) -> pb.InspectBlockResponse:  # noqa: N802
        ns = self.store.namespace(request.namespace)
        block = self.store.find_block(ns, request.hash)
        data = self.pool.view.read_blocks(decode_page_ids(block.pages, ns.pages_per_block), ns.block_bytes)
        return pb.InspectBlockResponse(
            block=_block_info(self.store, block),
            page_ids=block.pages,
            checksum_xxh3=xxhash.xxh3_64_hexdigest(data),
            stored_checksum=int(self.store.checksum[block.slot]),
            checksum=int(checksum.block_checksums(data)[0]),
        )

    @unary
    def DeleteBlocks(self, request: pb.DeleteBlocksRequest, context) -> pb.DeleteBlocksResponse:  # noqa: N802
        ns = self.store.namespace(request.namespace)
        deleted = self.store.delete(ns, self.store.split_hashes(ns, request.hashes))
        log.info("blocks deleted", extra={"namespace": ns.id, "deleted": deleted, "peer": context.peer()})
        return pb.DeleteBlocksResponse(deleted_count=deleted)

    @unary
    def Clear(self, request: pb.ClearRequest, context) -> pb.ClearResponse:  # noqa: N802
        if request.all == bool(request.namespace):
            raise InvalidArgument("give either a namespace or all=true")
        ns: Namespace | None = None if request.all else self.store.namespace(request.namespace)
        deleted = self.store.clear(ns)
        log.info("cache cleared", extra={"namespace": ns.id if ns else "*", "deleted": deleted, "peer": context.peer()})
        return pb.ClearResponse(deleted_count=deleted)

    @unary
    def ListEngines(self, request, context) -> pb.ListEnginesResponse:  # noqa: N802
        response = pb.ListEnginesResponse()
        for s in self.sessions.all():
            c = s.counters
            response.engines.add(
                session_id=s.id,
                engine_name=s.engine_name,
                pid=s.pid,
                hostname=s.hostname,
                peer=s.peer,
                connected_at=s.connected_at,
                namespaces=sorted(s.namespaces),
                lookups=c.lookups,
                hit_blocks=c.hit_blocks,
                miss_blocks=c.miss_blocks,
                stored_blocks=c.stored_blocks,
                loaded_blocks=c.loaded_blocks,
                stored_bytes=c.stored_bytes,
                loaded_bytes=c.loaded_bytes,
            )
        return response


def _block_info(store: BlockStore, block: Block) -> pb.BlockInfo:
    slot = block.slot
    return pb.BlockInfo(
        namespace=block.namespace.id,
        hash=block.hash,
        tier=RAM_TIER,
        size_bytes=block.namespace.block_bytes,
        hits=int(store.hits[slot]),
        created_at=float(store.created_at[slot]),
        last_access_at=float(store.last_access[slot]),
        pins=int(store.pins[slot]),
    )
