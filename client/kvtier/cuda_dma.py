"""Batched DMA copies through the CUDA driver's cuMemcpyBatchAsync (its CUDA 13 form, cuMemcpyBatchAsync_v2:
drivers of CUDA 13 and later; with an older driver `available()` is False and every copy takes the kernel).

The copy engines move host<->device bytes at the full PCIe rate (about 0.98 of a bulk memcpy on an
H200 for runs of 1 MiB or more), where a kernel reading or writing host memory reaches about 0.92.
Each copy of a batch has a fixed cost in the driver and the engine, so batches of small runs (the
32 KiB pages of a scattered pool) go slower than the kernel: gpu_copy picks DMA only for long runs.
One ctypes call per batch; the address arrays are passed as they are (no Python list per run).
"""

from __future__ import annotations

import ctypes

import numpy as np

_SRC_ACCESS_ORDER_STREAM = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM: sources are read in stream order


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


def _driver():
    """libcuda with cuMemcpyBatchAsync as CUDA 13 declares it (no failIdx), or None on older drivers
    or without CUDA."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
        batch = driver.cuMemcpyBatchAsync_v2
    except (OSError, AttributeError):
        return None
    pointer, size = ctypes.c_void_p, ctypes.c_size_t
    batch.argtypes = [pointer, pointer, pointer, size, pointer, pointer, size, pointer]  # dsts .. numAttrs, stream
    driver.cuStreamGetCtx.argtypes = [pointer, ctypes.POINTER(pointer)]
    driver.cuCtxPushCurrent_v2.argtypes = [pointer]
    driver.cuCtxPopCurrent_v2.argtypes = [ctypes.POINTER(pointer)]
    return driver


_DRIVER = _driver()
_IN_STREAM_ORDER = _MemcpyAttributes(_SRC_ACCESS_ORDER_STREAM, _MemLocation(), _MemLocation(), 0)
_FIRST_COPY = (ctypes.c_size_t * 1)(0)


def available() -> bool:
    return _DRIVER is not None


def copy(dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, stream_handle: int) -> None:
    """Enqueue copies src[i] -> dst[i] of sizes[i] bytes on the stream (not the legacy default stream),
    in the stream's context."""
    dst, src, sizes = (np.ascontiguousarray(a, dtype=np.uint64) for a in (dst, src, sizes))
    context = ctypes.c_void_p()
    _check("cuStreamGetCtx", _DRIVER.cuStreamGetCtx(stream_handle, ctypes.byref(context)))
    # The driver call needs the stream's context current on this thread, which torch's device guard
    # does not promise (a fresh thread whose runtime device is already the right one gets none).
    _check("cuCtxPushCurrent", _DRIVER.cuCtxPushCurrent_v2(context))
    try:
        status = _DRIVER.cuMemcpyBatchAsync_v2(
            dst.ctypes.data,
            src.ctypes.data,
            sizes.ctypes.data,
            len(sizes),
            ctypes.addressof(_IN_STREAM_ORDER),
            ctypes.addressof(_FIRST_COPY),
            1,
            stream_handle,
        )
    finally:
        _DRIVER.cuCtxPopCurrent_v2(ctypes.byref(context))
    _check("cuMemcpyBatchAsync", status)


def _check(call: str, status: int) -> None:
    if status != 0:
        raise RuntimeError(f"{call} failed with CUresult {status}")
