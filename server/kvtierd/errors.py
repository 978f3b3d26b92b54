"""Errors the daemon reports to clients; each maps to one gRPC status code."""

from __future__ import annotations

import grpc


class KVTierError(Exception):
    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidArgument(KVTierError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(KVTierError):
    code = grpc.StatusCode.NOT_FOUND


class PermissionDenied(KVTierError):
    code = grpc.StatusCode.PERMISSION_DENIED


class FailedPrecondition(KVTierError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class OutOfRange(KVTierError):
    code = grpc.StatusCode.OUT_OF_RANGE


class ResourceExhausted(KVTierError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unauthenticated(KVTierError):
    """The call names a session the daemon does not know (never opened, closed, or the daemon restarted)."""

    code = grpc.StatusCode.UNAUTHENTICATED


class DeadlineExceeded(KVTierError):
    """A cuda_ipc copy that could not end by the call's deadline (after which the engine may reuse its blocks)."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


class DataLoss(KVTierError):
    code = grpc.StatusCode.DATA_LOSS
