"""`kvtierctl`: inspect and manage a running kvtierd through its admin API.

Every command prints a readable table, or one JSON document with --json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections.abc import Callable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtier.client import channel_options
from kvtier.messages import message_to_dict
from kvtier.paths import normalize_address
from kvtier.sizes import format_size
from kvtier.v1 import kvtier_pb2 as pb
from kvtier.v1 import kvtier_pb2_grpc as pb_grpc


def _when(stamp: float) -> str:
    return datetime.datetime.fromtimestamp(stamp).isoformat(sep=" ", timespec="seconds") if stamp else "-"


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    cells = [[str(c) for c in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _tier_rows(label: str, tiers) -> list[list[object]]:
    return [
        [
            label,
            t.tier,
            t.blocks,
            format_size(t.bytes),
            format_size(t.capacity_bytes),
            t.hits,
            t.misses,
            f"{t.hit_ratio:.1%}",
            t.evictions,
            t.checksum_failures,
        ]
        for t in tiers
    ]


def show_info(r: pb.GetInfoResponse) -> str:
    lines = [
        f"kvtierd {r.version}, started {_when(r.started_at)}",
        f"socket      {r.socket_path}",
        f"tcp         {r.tcp_listen or 'off'}",
        f"metrics     {'port ' + str(r.metrics_port) if r.metrics_port else 'off'}",
        f"pool        {format_size(r.pool.size_bytes)} in {r.pool.shm_path}, pages of {format_size(r.pool.page_size)}, "
        f"CUDA-pinned: {'yes' if r.pool.cuda_registered else 'no'}",
        f"limits      {r.limits.max_batch_blocks} blocks/call, {format_size(r.limits.max_message_bytes)}/message, "
        f"lease {r.limits.lease_ttl_ms} ms, {r.limits.max_namespaces} namespaces",
        "",
        table(["option", "value"], sorted(r.config.items())),
    ]
    return "\n".join(lines)


def show_stats(r: pb.GetStatsResponse) -> str:
    headers = ["namespace", "tier", "blocks", "bytes", "capacity", "hits", "misses", "hit ratio", "evictions", "bad files"]
    rows = _tier_rows("(all)", r.tiers)
    for ns in r.namespaces:
        rows += _tier_rows(ns.namespace, ns.tiers)
    summary = (
        f"engines connected: {r.engines_connected}   reserved: {format_size(r.reserved_bytes)}   pinned blocks: {r.pinned_blocks}"
    )
    for t in r.tiers:
        if t.tier == "fs":
            summary += f"\nfs tier: {t.io_errors} I/O errors, stores {'PAUSED after a disk failure' if t.stores_paused else 'on'}"
    return table(headers, rows) + "\n\n" + summary


def show_namespaces(r: pb.ListNamespacesResponse) -> str:
    rows = [
        [
            n.namespace,
            n.spec.model_id,
            n.spec.kv_dtype,
            n.spec.tokens_per_block,
            format_size(n.spec.block_bytes),
            n.spec.tp_size or 1,
            n.blocks,
            format_size(n.bytes),
            n.engines,
        ]
        for n in r.namespaces
    ]
    return table(["namespace", "model", "dtype", "tokens/block", "block size", "tp size", "blocks", "bytes", "engines"], rows)


def _block_rows(blocks) -> list[list[object]]:
    return [
        [b.namespace, b.hash.hex(), b.tier, format_size(b.size_bytes), b.hits, b.pins, _when(b.last_access_at)] for b in blocks
    ]


_BLOCK_HEADERS = ["namespace", "hash", "tier", "size", "hits", "pins", "last access"]


def show_blocks(r: pb.ListBlocksResponse) -> str:
    footer = f"\n{len(r.blocks)} of {r.total} blocks" + (
        f"; next page: --page-token {r.next_page_token}" if r.next_page_token else ""
    )
    return table(_BLOCK_HEADERS, _block_rows(r.blocks)) + footer


def show_inspect(r: pb.InspectBlockResponse) -> str:
    verdict = "no checksum stored" if not r.stored_checksum else ("intact" if r.checksum == r.stored_checksum else "CORRUPT")
    return (
        table(_BLOCK_HEADERS, _block_rows([r.block]))
        + f"\n\nchecksum (xxh3-64): {r.checksum_xxh3}\nkvtier checksum: {r.checksum:016x} "
        + f"(stored {r.stored_checksum:016x}: {verdict})\ncreated: {_when(r.block.created_at)}"
    )


def show_engines(r: pb.ListEnginesResponse) -> str:
    rows = [
        [
            e.engine_name,
            e.pid,
            e.session_id[:12],
            _when(e.connected_at),
            len(e.namespaces),
            e.lookups,
            e.hit_blocks,
            e.miss_blocks,
            e.stored_blocks,
            e.loaded_blocks,
        ]
        for e in r.engines
    ]
    return table(["engine", "pid", "session", "connected", "namespaces", "lookups", "hits", "misses", "stored", "loaded"], rows)


def _hashes(values: Sequence[str], size: int | None = None) -> bytes:
    """The hashes joined (as the API takes them), each checked to have the namespace's `size` bytes
    when it is known (hashes of a wrong length could join into hashes of the right one)."""
    try:
        hashes = [bytes.fromhex(v) for v in values]
    except ValueError as exc:
        raise SystemExit(f"kvtierctl: block hashes are hex strings: {exc}") from exc
    wrong = next((v for v, h in zip(values, hashes, strict=True) if len(h) != size), None) if size is not None else None
    if wrong is not None:
        raise SystemExit(f"kvtierctl: the namespace's block hashes have {size} bytes, not {wrong!r}")
    return b"".join(hashes)


def _hash_bytes(stub: pb_grpc.KVTierAdminStub, namespace: str, timeout: float) -> int | None:
    """The namespace's hash size, or None when the daemon does not know it (it answers NOT_FOUND)."""
    listed = stub.ListNamespaces(pb.ListNamespacesRequest(), timeout=timeout).namespaces
    return next((info.spec.hash_bytes for info in listed if info.namespace == namespace), None)


def run_command(
    stub: pb_grpc.KVTierAdminStub, args: argparse.Namespace, timeout: float
) -> tuple[object, Callable[[object], str]]:
    """Call the admin RPC for `args.command`; returns (response, formatter)."""
    c = args.command
    if c == "info":
        return stub.GetInfo(pb.GetInfoRequest(), timeout=timeout), show_info
    if c == "stats":
        return stub.GetStats(pb.GetStatsRequest(namespace=args.namespace or ""), timeout=timeout), show_stats
    if c == "namespaces":
        return stub.ListNamespaces(pb.ListNamespacesRequest(), timeout=timeout), show_namespaces
    if c == "blocks":
        order = pb.BLOCK_ORDER_HITS if args.order == "hits" else pb.BLOCK_ORDER_RECENCY
        request = pb.ListBlocksRequest(
            namespace=args.namespace or "", order=order, page_size=args.limit, page_token=args.page_token or "", tier=args.tier
        )
        return stub.ListBlocks(request, timeout=timeout), show_blocks
    if c == "inspect":
        request = pb.InspectBlockRequest(namespace=args.namespace, hash=_hashes([args.hash]), tier=args.tier)
        return stub.InspectBlock(request, timeout=timeout), show_inspect
    if c == "delete":
        hashes = _hashes(args.hashes, _hash_bytes(stub, args.namespace, timeout))
        request = pb.DeleteBlocksRequest(namespace=args.namespace, hashes=hashes)
        return stub.DeleteBlocks(request, timeout=timeout), lambda r: f"deleted {r.deleted_count} blocks"
    if c == "clear":
        if not args.all and not args.namespace:
            raise SystemExit("kvtierctl clear: give --namespace NS or --all")
        request = pb.ClearRequest(namespace=args.namespace or "", all=args.all)
        return stub.Clear(request, timeout=timeout), lambda r: f"deleted {r.deleted_count} blocks"
    if c == "engines":
        return stub.ListEngines(pb.ListEnginesRequest(), timeout=timeout), show_engines
    raise AssertionError(c)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvtierctl", description="Inspect and manage a running kvtierd.")
    parser.add_argument(
        "--address", default=None, help="unix:///path/to.sock, a socket path or HOST:PORT (default: the daemon's default socket)"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the daemon")
    # --json is accepted after the command too (`kvtierctl stats --json`).
    json_after = argparse.ArgumentParser(add_help=False)
    json_after.add_argument("--json", action="store_true", default=argparse.SUPPRESS, help="print one JSON document")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, parents=[json_after])

    command("info", help="version, pool, limits and configuration")
    stats = command("stats", "blocks, bytes, hits, misses and evictions per tier and namespace")
    stats.add_argument("--namespace")
    command("namespaces", "namespaces and their geometry")
    blocks = command("blocks", "list cached blocks (paged)")
    blocks.add_argument("--namespace")
    blocks.add_argument("--order", choices=("recency", "hits"), default="recency")
    blocks.add_argument("--limit", type=_positive, default=50, help="blocks per page (1 to 10000)")
    blocks.add_argument("--page-token")
    blocks.add_argument("--tier", choices=("ram", "fs", ""), default="", help="only blocks of this tier (default: both)")
    inspect = command("inspect", "one block's details and checksum")
    inspect.add_argument("namespace")
    inspect.add_argument("hash", help="hex")
    inspect.add_argument("--tier", choices=("ram", "fs", ""), default="", help="which copy (default: the pool's, else disk's)")
    delete = command("delete", "delete blocks")
    delete.add_argument("namespace")
    delete.add_argument("hashes", nargs="+", help="hex")
    clear = command("clear", "delete every block of a namespace, or all")
    clear.add_argument("--namespace")
    clear.add_argument("--all", action="store_true")
    command("engines", "connected engines and their counters")
    command("health", "grpc.health.v1 status")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    address = normalize_address(args.address)
    with grpc.insecure_channel(address, options=channel_options()) as channel:
        try:
            if args.command == "health":
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=args.timeout)
                status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
                print(json.dumps({"status": status}) if args.json else status)
                return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1
            response, formatter = run_command(pb_grpc.KVTierAdminStub(channel), args, args.timeout)
        except grpc.RpcError as exc:
            print(f"kvtierctl: {args.command} failed: {exc.code().name}: {exc.details()} (daemon at {address})", file=sys.stderr)
            return 2
    print(json.dumps(message_to_dict(response), indent=2) if args.json else formatter(response))
    return 0


if __name__ == "__main__":
    sys.exit(main())
