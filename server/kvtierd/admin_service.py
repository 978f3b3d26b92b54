"""KVTierAdmin: the operator API behind kvtierctl."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import numpy as np
import xxhash

from kvtier import checksum
from kvtier.pool_view import decode_page_ids
from kvtier.v1 import kvtier_pb2 as pb
from kvtier.v1 import kvtier_pb2_grpc as pb_grpc
from kvtierd.block_store import RAM_TIER, Block, BlockStore, Namespace, TierCounters
from kvtierd.errors import FailedPrecondition, InvalidArgument
from kvtierd.fs_index import FsEntry
from kvtierd.fs_tier import FS_TIER, FsTier
from kvtierd.metrics import Metrics
from kvtierd.rpc import check_sendable, unary
from kvtierd.sessions import SessionRegistry
from kvtierd.shm_pool import SharedPool

log = logging.getLogger("kvtierd.admin")

DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 10_000


class AdminService(pb_grpc.KVTierAdminServicer):
    def __init__(
        self,
        store: BlockStore,
        pool: SharedPool,
        sessions: SessionRegistry,
        metrics: Metrics,
        info: pb.GetInfoResponse,
        fs: FsTier | None = None,
    ) -> None:
        self.store = store
        self.pool = pool
        self.sessions = sessions
        self.metrics = metrics
        self.info = info
        self.fs = fs

    @unary
    def GetInfo(self, request, context) -> pb.GetInfoResponse:  # noqa: N802
        return self.info

    @unary
    def GetStats(self, request: pb.GetStatsRequest, context) -> pb.GetStatsResponse:  # noqa: N802
        store = self.store
        selected = [store.namespace(request.namespace)] if request.namespace else list(store.namespaces.values())
        usage = store.usage()
        totals = TierCounters()
        if not request.namespace:
            totals.add(store.retired)  # (the daemon's counters only go up)
        response = pb.GetStatsResponse(
            reserved_bytes=usage.reserved_pages * store.page_size,
            pinned_blocks=usage.pinned_blocks,
            engines_connected=len(self.sessions),
            pool_used_bytes=usage.used_pages * store.page_size,
        )
        blocks = used = 0
        for ns in selected:
            tiers = [self._tier_stats(ns.counters, len(ns.blocks), len(ns.blocks) * ns.block_bytes)]
            if self.fs is not None:
                tiers.append(self._fs_stats(ns.id))
            response.namespaces.add(namespace=ns.id, model_id=ns.spec.model_id, tiers=tiers)
            totals.add(ns.counters)
            blocks += len(ns.blocks)
            used += len(ns.blocks) * ns.block_bytes
        response.tiers.append(self._tier_stats(totals, blocks, used))
        if self.fs is not None:
            fs_total = self._fs_stats(request.namespace or None)
            fs_total.io_errors = self.fs.health.read_errors + self.fs.health.write_errors
            fs_total.stores_paused = self.fs.health.paused
            response.tiers.append(fs_total)
        return response

    def _tier_stats(self, counters: TierCounters, blocks: int, used: int) -> pb.TierStats:
        return _stats(
            RAM_TIER,
            counters.hits,
            counters.misses,
            blocks=blocks,
            bytes=used,
            capacity_bytes=self.store.capacity_bytes,
            evictions=counters.evictions,
            stored_blocks=counters.stored_blocks,
            loaded_blocks=counters.loaded_blocks,
        )

    def _fs_stats(self, ns_id: str | None) -> pb.TierStats:
        counters, blocks, used = self.fs.totals(ns_id)
        return _stats(
            FS_TIER,
            counters.hits,
            counters.misses,
            blocks=blocks,
            bytes=used,
            capacity_bytes=self.fs.settings.capacity,
            evictions=counters.evictions,
            stored_blocks=counters.stored_blocks,
            loaded_blocks=counters.loaded_blocks,
            checksum_failures=counters.checksum_failures,
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
    async def ListBlocks(self, request: pb.ListBlocksRequest, context) -> pb.ListBlocksResponse:  # noqa: N802
        ns = self.store.namespace(request.namespace) if request.namespace else None
        page_size = request.page_size or DEFAULT_PAGE_SIZE
        if page_size > MAX_PAGE_SIZE:
            raise InvalidArgument(f"page_size {page_size} exceeds {MAX_PAGE_SIZE}")
        token = request.page_token or "0"
        if not (token.isascii() and token.isdigit() and len(token) <= 20):  # (an offset: a uint64 at most)
            raise InvalidArgument(f"bad page_token {request.page_token!r}")
        offset = int(token)
        tier = self._tier(request.tier)
        blocks = list(self.store.committed_blocks(ns)) if tier in ("", RAM_TIER) else []
        figures = _PoolFigures.of(self.store, blocks)  # (a slot may go to another block while the page is ranked)
        entries = self.fs.index.entries(ns.id if ns else None) if self.fs is not None and tier in ("", FS_TIER) else []
        response = await asyncio.to_thread(self._blocks_page, blocks, figures, entries, request.order, offset, page_size)
        check_sendable(response, self.info.limits.max_message_bytes, f"ask for fewer blocks a page than {page_size}")
        return response

    def _blocks_page(  # noqa: PLR0913
        self, blocks: list[Block], figures: _PoolFigures, entries: list[FsEntry], order_by: int, offset: int, page_size: int
    ) -> pb.ListBlocksResponse:
        """The page of these blocks (lists and the pool blocks' figures taken on the event loop) in the
        order asked for. On a thread: ranking a million disk entries takes a few hundred ms here, during
        which the event loop goes on serving (between the GIL's switches) instead of stopping every
        engine's calls."""
        last_access = np.concatenate(
            [figures.last_access, np.fromiter((e.last_access for e in entries), dtype=np.float64, count=len(entries))]
        )
        hits = np.concatenate([figures.hits, np.fromiter((e.hits for e in entries), dtype=np.int64, count=len(entries))])
        if order_by == pb.BLOCK_ORDER_HITS:
            order = np.lexsort((-last_access, -hits))
        else:
            order = np.argsort(-last_access, kind="stable")
        total = len(blocks) + len(entries)
        page = order[offset : offset + page_size].tolist()
        infos = [figures.info(blocks[i], i) if i < len(blocks) else self._fs_info(entries[i - len(blocks)]) for i in page]
        response = pb.ListBlocksResponse(blocks=infos, total=total)
        if offset + page_size < total:
            response.next_page_token = str(offset + page_size)
        return response

    def _tier(self, tier: str) -> str:
        if tier not in ("", RAM_TIER, FS_TIER):
            raise InvalidArgument(f"tier must be {RAM_TIER!r}, {FS_TIER!r} or empty, not {tier!r}")
        if tier == FS_TIER and self.fs is None:
            raise FailedPrecondition("the filesystem tier is off (start the daemon with --fs-path)")
        return tier

    def _fs_info(self, entry: FsEntry) -> pb.BlockInfo:
        return pb.BlockInfo(
            namespace=entry.namespace,
            hash=entry.hash,
            tier=FS_TIER,
            size_bytes=self.fs.index.block_bytes[entry.namespace],  # (known or not to the store: retired)
            hits=entry.hits,
            created_at=entry.created_at,
            last_access_at=entry.last_access,
        )

    @unary
    async def InspectBlock(self, request: pb.InspectBlockRequest, context) -> pb.InspectBlockResponse:  # noqa: N802
        ns = self.store.namespace(request.namespace)
        tier = self._tier(request.tier)
        on_disk = self.fs is not None and self.fs.index.get(ns.id, request.hash) is not None
        if tier == RAM_TIER or (tier == "" and (request.hash in ns.blocks or not on_disk)):
            block = self.store.find_block(ns, request.hash)
            info, stored = _PoolFigures.of(self.store, [block]).info(block, 0), int(self.store.checksum[block.slot])
            pages = decode_page_ids(block.pages, ns.pages_per_block)
            with self.store.held(ns, [request.hash]):  # (read on a thread: a block may be GiBs)
                xxh3, computed = await asyncio.to_thread(lambda: _digests(self.pool.view.read_blocks(pages, ns.block_bytes)))
            response = pb.InspectBlockResponse(block=info, page_ids=block.pages, stored_checksum=stored)
        else:
            if len(request.hash) != ns.hash_bytes:
                raise InvalidArgument(f"hash has {len(request.hash)} bytes; the namespace's hashes have {ns.hash_bytes}")
            entry, data, header = await self.fs.inspect(ns, request.hash)
            xxh3, computed = await asyncio.to_thread(_digests, data[np.newaxis])
            response = pb.InspectBlockResponse(block=self._fs_info(entry), stored_checksum=header.checksum)
        response.checksum_xxh3, response.checksum = xxh3, computed
        return response

    @unary
    async def DeleteBlocks(self, request: pb.DeleteBlocksRequest, context) -> pb.DeleteBlocksResponse:  # noqa: N802
        """Answers once the blocks' files are removed (a crash then cannot bring them back)."""
        ns = self.store.namespace(request.namespace)
        hashes = self.store.split_hashes(ns, request.hashes)
        deleted = {h for h in hashes if h in ns.blocks}
        self.store.delete(ns, hashes)
        if self.fs is not None:
            on_disk = self.fs.delete(ns.id, hashes)
            deleted |= on_disk.hashes[ns.id]
            await self.fs.gone(on_disk)
        log.info("blocks deleted", extra={"namespace": ns.id, "deleted": len(deleted), "peer": context.peer()})
        return pb.DeleteBlocksResponse(deleted_count=len(deleted))

    @unary
    async def Clear(self, request: pb.ClearRequest, context) -> pb.ClearResponse:  # noqa: N802
        """Answers once the blocks' files are removed (a crash then cannot bring them back)."""
        if request.all == bool(request.namespace):
            raise InvalidArgument("give either a namespace or all=true")
        ns: Namespace | None = None if request.all else self.store.namespace(request.namespace)
        in_pool = {n.id: set(n.blocks) for n in ([ns] if ns is not None else self.store.namespaces.values())}
        self.store.clear(ns)
        on_disk = {}
        if self.fs is not None:
            deletion = self.fs.clear(ns.id if ns is not None else None)
            on_disk = deletion.hashes
            await self.fs.gone(deletion)
        deleted = sum(len(in_pool.get(n, set()) | on_disk.get(n, set())) for n in in_pool.keys() | on_disk.keys())
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
        check_sendable(response, self.info.limits.max_message_bytes, "too many engines are connected to list them in one answer")
        return response


@dataclass(frozen=True)
class _PoolFigures:
    """Per-block figures of pool blocks, copied when the blocks were listed (a block evicted or deleted
    since gives its slot, and the slot's figures, to another)."""

    hits: np.ndarray
    created_at: np.ndarray
    last_access: np.ndarray
    pins: np.ndarray

    @classmethod
    def of(cls, store: BlockStore, blocks: list[Block]) -> _PoolFigures:
        slots = np.fromiter((b.slot for b in blocks), dtype=np.int64, count=len(blocks))
        return cls(store.hits[slots].astype(np.int64), store.created_at[slots], store.last_access[slots], store.pins[slots])

    def info(self, block: Block, index: int) -> pb.BlockInfo:
        """`block`, listed at `index`."""
        return pb.BlockInfo(
            namespace=block.namespace.id,
            hash=block.hash,
            tier=RAM_TIER,
            size_bytes=block.namespace.block_bytes,
            hits=int(self.hits[index]),
            created_at=float(self.created_at[index]),
            last_access_at=float(self.last_access[index]),
            pins=int(self.pins[index]),
        )


def _stats(tier: str, hits: int, misses: int, **values: int) -> pb.TierStats:
    asked = hits + misses
    return pb.TierStats(tier=tier, hits=hits, misses=misses, hit_ratio=hits / asked if asked else 0.0, **values)


def _digests(block: np.ndarray) -> tuple[str, int]:
    """(xxh3-64 hex, kvtier checksum) of one block's bytes [1, block_bytes]."""
    return xxhash.xxh3_64_hexdigest(block), int(checksum.block_checksums(block)[0])
