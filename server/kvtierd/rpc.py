"""Turns a plain handler into a grpc.aio unary method: timing, error statuses and log lines; and
registers services so that a request that does not parse reaches it (INVALID_ARGUMENT, logged and
counted) instead of failing inside gRPC (UNKNOWN, unlogged)."""

from __future__ import annotations

import functools
import inspect
import logging
import time
from dataclasses import dataclass

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError

from kvtier.v1 import kvtier_pb2 as pb
from kvtierd.errors import InvalidArgument, KVTierError, ResourceExhausted
from kvtierd.metrics import Metrics

log = logging.getLogger("kvtierd.rpc")

MAX_DETAILS_CHARS = 1000  # a refusal's message, which may repeat what the client sent, is clipped to this


def clipped(message: str) -> str:
    """The message cut to MAX_DETAILS_CHARS: gRPC sends it as response metadata, which clients refuse
    over 16 KiB (the call would then fail with RESOURCE_EXHAUSTED instead of its status), and it goes
    into a log line."""
    if len(message) <= MAX_DETAILS_CHARS:
        return message
    return f"{message[:MAX_DETAILS_CHARS]}... ({len(message) - MAX_DETAILS_CHARS} more characters)"


def check_sendable(response, limit: int, advice: str) -> None:
    """Refuse a response over the message limit (RESOURCE_EXHAUSTED, logged like any refusal): gRPC
    would fail to send it after the handler, unlogged, and the caller never learn why."""
    size = response.ByteSize()
    if size > limit:
        raise ResourceExhausted(f"the answer would be {size} bytes, over the message limit of {limit}; {advice}")


@dataclass(frozen=True)
class Malformed:
    """A request whose bytes did not parse, handed to the handler to refuse."""

    reason: str


def parse(request_type):
    """A request deserializer that gives Malformed instead of raising."""

    def deserialize(data: bytes):
        try:
            return request_type.FromString(data)
        except DecodeError as exc:
            return Malformed(str(exc))

    return deserialize


def add_service(server: grpc.aio.Server, servicer, service: ServiceDescriptor) -> None:
    """Register the servicer's methods (as the generated add_*Servicer_to_server does), unary
    requests parsed by `parse`."""
    handlers = {}
    for method in service.methods:
        request, response = getattr(pb, method.input_type.name), getattr(pb, method.output_type.name)
        if method.client_streaming and method.server_streaming:
            make, deserialize = grpc.stream_stream_rpc_method_handler, request.FromString
        elif not (method.client_streaming or method.server_streaming):
            make, deserialize = grpc.unary_unary_rpc_method_handler, parse(request)
        else:
            raise ValueError(f"{method.full_name}: only unary and bidirectional methods are served")
        handlers[method.name] = make(
            getattr(servicer, method.name), request_deserializer=deserialize, response_serializer=response.SerializeToString
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


def unary(method):
    """`method(self, request, context) -> response` (or a coroutine of it); `self.metrics` must be a Metrics."""
    name = method.__name__

    @functools.wraps(method)
    async def handler(self, request, context: grpc.aio.ServicerContext):
        metrics: Metrics = self.metrics
        started = time.perf_counter()
        try:
            if isinstance(request, Malformed):
                raise InvalidArgument(f"malformed {name} request: {request.reason}")
            response = method(self, request, context)
            return await response if inspect.isawaitable(response) else response
        except KVTierError as exc:
            code, message = exc.code, clipped(str(exc))
            log.warning("request refused", extra={"method": name, "code": code.name, "reason": message, "peer": context.peer()})
        except Exception:  # a bug must not take the daemon down: report INTERNAL and keep serving
            code, message = grpc.StatusCode.INTERNAL, f"internal error in {name}; see the daemon log"
            log.exception("request failed", extra={"method": name, "peer": context.peer()})
        finally:
            metrics.rpc_duration.labels(name).observe(time.perf_counter() - started)
        metrics.rpc_errors.labels(name, code.name).inc()
        await context.abort(code, message)

    return handler
