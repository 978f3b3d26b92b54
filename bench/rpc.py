"""RPC cost of the data plane against a bare gRPC round trip of the same message sizes, and the same
lookups over the data socket (kvtier.data_socket), in one run. Store and load go through the client,
which uses the data socket.

Writes bench/results/rpc.json and bench/results/rpc.md. Usage: python bench/rpc.py [--quick]
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import grpc

from common import RESULTS, start_daemon, stop_daemon, timed, write_result  # isort: skip

from blocks import chain_hashes, contents, spec  # noqa: E402

from kvtier.client import KVTierClient  # noqa: E402
from kvtier.v1 import kvtier_pb2 as pb  # noqa: E402

BLOCK_BYTES = 256 << 10  # a small CPU-engine block (all layers)
BATCH = 64


def echo_call(address: str, request_bytes: int, reply_bytes: int):
    directory = Path(tempfile.mkdtemp(prefix="kvt-echo-", dir="/tmp"))
    socket_address = f"unix://{directory}/echo.sock"
    server = subprocess.Popen(
        [sys.executable, str(Path(__file__).parent / "echo_server.py"), socket_address, str(reply_bytes)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert server.stdout.readline().strip() == "ready"
    channel = grpc.insecure_channel(socket_address)
    rpc = channel.unary_unary("/bench.Echo/Echo", request_serializer=None, response_deserializer=None)
    payload = b"q" * request_bytes
    return server, channel, lambda: rpc(payload, timeout=10)


def main() -> None:
    quick = "--quick" in sys.argv
    iterations = 300 if quick else 2000
    heavy_iterations = 30 if quick else 200
    daemon = start_daemon("--pool-size", "1GiB", "--log-level", "warning")
    results: dict[str, dict] = {}
    try:
        with KVTierClient(daemon.address, engine_name="bench") as client:
            ns = client.register(spec(block_bytes=BLOCK_BYTES))
            cached = chain_hashes("bench", 1024)
            for start in range(0, 1024, 128):
                client.store(ns, cached[start : start + 128], contents(cached[start : start + 128], BLOCK_BYTES))
            session = client.state.session_id
            for count in (1, 64, 1024):
                request = pb.LookupRequest(session_id=session, namespace=ns.id, hashes=b"".join(cached[:count]))
                response_size = client._stub.Lookup(request).ByteSize()
                server, channel, echo = echo_call(daemon.address, request.ByteSize(), response_size)
                try:
                    results[f"echo_{count}"] = timed(echo, iterations)
                    results[f"lookup_{count}"] = timed(lambda r=request: client._stub.Lookup(r, timeout=10), iterations)
                    results[f"lookup_{count}_data_socket"] = timed(
                        lambda r=request: client.data_socket.call("Lookup", r), iterations
                    )
                finally:
                    channel.close()
                    server.kill()
                assert client.lookup(ns, cached[:count]).hit_count == count

            batch = chain_hashes("store-batch", BATCH)
            data = contents(batch, BLOCK_BYTES)

            def store_cycle():  # reserve + copy into the pool + commit, then delete so the next one stores again
                assert client.store(ns, batch, data) == BATCH
                client.admin.DeleteBlocks(pb.DeleteBlocksRequest(namespace=ns.id, hashes=b"".join(batch)))

            delete_only = lambda: client.admin.DeleteBlocks(pb.DeleteBlocksRequest(namespace=ns.id, hashes=b"".join(batch)))
            results[f"store_{BATCH}"] = timed(store_cycle, heavy_iterations, warmup=5)
            results["delete_overhead"] = timed(delete_only, heavy_iterations, warmup=5)
            results[f"load_{BATCH}"] = timed(lambda: client.load(ns, cached[:BATCH]), heavy_iterations, warmup=5)
            results[f"lookup_pin_release_{BATCH}"] = timed(
                lambda: client.release(client.lookup(ns, cached[:BATCH], pin=True).lease_id), iterations
            )
    finally:
        stop_daemon(daemon)

    echo_64 = results["echo_64"]["p50_ms"]
    store_ms = results[f"store_{BATCH}"]["p50_ms"] - results["delete_overhead"]["p50_ms"]
    load_ms = results[f"load_{BATCH}"]["p50_ms"]
    batch_gb = BATCH * BLOCK_BYTES / 1e9
    summary = {
        "echo_p50_ms": results["echo_1024"]["p50_ms"],
        "lookup_1024_p50_ms": results["lookup_1024"]["p50_ms"],
        "lookup_1024_ratio_vs_echo": results["lookup_1024"]["p50_ms"] / results["echo_1024"]["p50_ms"],
        "lookup_64_ratio_vs_echo": results["lookup_64"]["p50_ms"] / echo_64,
        "lookup_1_ratio_vs_echo": results["lookup_1"]["p50_ms"] / results["echo_1"]["p50_ms"],
        "lookup_1_data_socket_p50_ms": results["lookup_1_data_socket"]["p50_ms"],
        "lookup_1_data_socket_vs_grpc": results["lookup_1_data_socket"]["p50_ms"] / results["lookup_1"]["p50_ms"],
        "lookup_1024_data_socket_vs_grpc": results["lookup_1024_data_socket"]["p50_ms"] / results["lookup_1024"]["p50_ms"],
        f"store_{BATCH}_p50_ms": store_ms,
        f"load_{BATCH}_p50_ms": load_ms,
        f"store_{BATCH}_GBps": batch_gb / (store_ms / 1000),
        f"load_{BATCH}_GBps": batch_gb / (load_ms / 1000),
    }
    command = "python bench/rpc.py" + (" --quick" if quick else "")
    path = write_result("rpc", {"block_bytes": BLOCK_BYTES, "summary": summary, "timings": results}, command)
    rows = [f"| {name} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | {r['n']} |" for name, r in results.items()]
    table = "\n".join(["| case | p50 ms | p99 ms | n |", "|---|---|---|---|", *rows])
    ratios = "\n".join(f"- {k}: {v:.3f}" for k, v in summary.items())
    (RESULTS / "rpc.md").write_text(
        f"# bench/rpc.py\n\nCommand: `{command}` (2-core machine, Unix socket, sync client, daemon on uvloop).\n"
        f"`echo_N` is a bare gRPC call with the request and reply sizes of `lookup_N` (over gRPC); `lookup_N_data_socket` is "
        f"the same call over the data socket. Store and load (over the data socket) move {BATCH} blocks of "
        f"{BLOCK_BYTES >> 10} KiB through the shm transport; `store_{BATCH}` includes an admin delete so every cycle stores anew "
        f"(`delete_overhead` is subtracted in the summary).\n\n{table}\n\n{ratios}\n"
    )
    print(table)
    print(ratios)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
