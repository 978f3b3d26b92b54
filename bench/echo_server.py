"""A bare gRPC server (grpc.aio on uvloop, like kvtierd) whose one method returns a fixed-size reply:
the floor any RPC pays for the same message sizes. Usage: python echo_server.py unix:///path REPLY_BYTES"""

from __future__ import annotations

import sys

import grpc
import uvloop

SERVICE = "bench.Echo"
METHOD = "Echo"


async def main(address: str, reply_bytes: int) -> None:
    reply = b"r" * reply_bytes

    async def echo(request: bytes, context) -> bytes:
        return reply

    handler = grpc.method_handlers_generic_handler(
        SERVICE, {METHOD: grpc.unary_unary_rpc_method_handler(echo, request_deserializer=None, response_serializer=None)}
    )
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(address)
    await server.start()
    print("ready", flush=True)
    await server.wait_for_termination()


if __name__ == "__main__":
    uvloop.run(main(sys.argv[1], int(sys.argv[2])))
