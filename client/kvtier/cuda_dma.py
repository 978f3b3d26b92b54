"""Batched DMA copies through the CUDA driver's cuMemcpyBatchAsync (driver 12.8 and later).

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


def _batch_function():
    """cuMemcpyBatchAsync as CUDA 13 declares it (no failIdx), or None on older drivers or without CUDA."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
        function = driver.cuMemcpyBatchAsync_v2
    except (OSError, AttributeError):
        return None
    pointer, size = ctypes.c_void_p, ctypes.c_size_t
    function.argtypes = [pointer, pointer, pointer, size, pointer, pointer, size, pointer]  # dsts .. numAttrs, stream
    function.restype = ctypes.c_int
    return function


_BATCH = _batch_function()
_IN_STREAM_ORDER = _MemcpyAttributes(_SRC_ACCESS_ORDER_STREAM, _MemLocation(), _MemLocation(), 0)
_FIRST_COPY = (ctypes.c_size_t * 1)(0)


def available() -> bool:
    return _BATCH is not None


def copy(dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, stream_handle: int) -> None:
    """Enqueue copies src[i] -> dst[i] of sizes[i] bytes on the stream (not the legacy default stream);
    the caller's thread must have the devices' context current (torch.cuda.device does that)."""
    dst, src, sizes = (np.ascontiguousarray(a, dtype=np.uint64) for a in (dst, src, sizes))
    status = _BATCH(
        dst.ctypes.data,
        src.ctypes.data,
        sizes.ctypes.data,
        len(sizes),
        ctypes.addressof(_IN_STREAM_ORDER),
        ctypes.addressof(_FIRST_COPY),
        1,
        stream_handle,
    )
    if status != 0:
        raise RuntimeError(f"cuMemcpyBatchAsync failed with CUresult {status}")
