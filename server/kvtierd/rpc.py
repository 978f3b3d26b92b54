"""Turns a plain handler into a grpc.aio unary method: timing, error statuses and log lines."""

from __future__ import annotations

import functools
import inspect
import logging
import time

import grpc

from kvtierd.errors import KVTierError, ResourceExhausted
from kvtierd.metrics import Metrics

log = logging.getLogger("kvtierd.rpc")


def check_sendable(response, limit: int, advice: str) -> None:
    """Refuse a response over the message limit (RESOURCE_EXHAUSTED, logged like any refusal): gRPC
    would fail to send it after the handler, unlogged, and the caller never learn why."""
    size = response.ByteSize()
    if size > limit:
        raise ResourceExhausted(f"the answer would be {size} bytes, over the message limit of {limit}; {advice}")


def unary(method):
    """`method(self, request, context) -> response` (or a coroutine of it); `self.metrics` must be a Metrics."""
    name = method.__name__

    @functools.wraps(method)
    async def handler(self, request, context: grpc.aio.ServicerContext):
        metrics: Metrics = self.metrics
        started = time.perf_counter()
        try:
            response = method(self, request, context)
            return await response if inspect.isawaitable(response) else response
        except KVTierError as exc:
            code, message = exc.code, str(exc)
            log.warning("request refused", extra={"method": name, "code": code.name, "reason": message, "peer": context.peer()})
        except Exception:  # a bug must not take the daemon down: report INTERNAL and keep serving
            code, message = grpc.StatusCode.INTERNAL, f"internal error in {name}; see the daemon log"
            log.exception("request failed", extra={"method": name, "peer": context.peer()})
        finally:
            metrics.rpc_duration.labels(name).observe(time.perf_counter() - started)
        metrics.rpc_errors.labels(name, code.name).inc()
        await context.abort(code, message)

    return handler
