"""DMA copies through the CUDA driver: batches of flat runs in one cuMemcpyBatchAsync (its CUDA 13
form, cuMemcpyBatchAsync_v2: drivers of CUDA 13 and later; with an older driver `available()` is False
and every copy takes the kernel), 2-D copies (rows of one width at a pitch), one
cuMemcpy2DAsync each, and single copies (cuMemcpyAsync).

The copy engines move host<->device bytes at the full PCIe rate (about 0.98 of a bulk memcpy on an
H200 for runs of 1 MiB or more), where a kernel reading or writing host memory reaches about 0.92.
Each copy has a fixed cost in the driver and the engine (a 2-D copy about 3 us of the copy engines'
time beyond its bytes, measured on an H200), so small copies (the 32 KiB pages of a scattered pool,
the 64 KiB layers of a few blocks) go slower than the kernel: gpu_copy picks DMA only for large ones.
A batch is one ctypes call, its address arrays passed as they are (no Python list per run); 2-D
copies are one call each (a load has one per layer and chunk).
"""

from __future__ import annotations

import contextlib
import ctypes

import numpy as np

_SRC_ACCESS_ORDER_STREAM = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM: sources are read in stream order


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Memcpy2D(ctypes.Structure):  # CUDA_MEMCPY2D
    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t),
        ("srcY", ctypes.c_size_t),
        ("srcMemoryType", ctypes.c_int),
        ("srcHost", ctypes.c_void_p),
        ("srcDevice", ctypes.c_uint64),
        ("srcArray", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t),
        ("dstY", ctypes.c_size_t),
        ("dstMemoryType", ctypes.c_int),
        ("dstHost", ctypes.c_void_p),
        ("dstDevice", ctypes.c_uint64),
        ("dstArray", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t),
        ("Height", ctypes.c_size_t),
    ]


_UNIFIED = 4  # CU_MEMORYTYPE_UNIFIED: the driver tells host from device addresses (both are UVA here)
MAX_PITCH = (1 << 31) - 1  # the driver's limit on a 2-D copy's pitch (CU_DEVICE_ATTRIBUTE_MAX_PITCH)


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
    driver.cuMemcpy2DAsync_v2.argtypes = [ctypes.POINTER(_Memcpy2D), pointer]
    driver.cuMemcpyAsync.argtypes = [ctypes.c_uint64, ctypes.c_uint64, size, pointer]
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
    with _stream_context(stream_handle):
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
    _check("cuMemcpyBatchAsync", status)


def copy_linear(dst: int, src: int, size: int, stream_handle: int) -> None:
    """Enqueue one copy of `size` bytes from src to dst on the stream, as `copy` does (one driver call
    with plain integers: no array to convert)."""
    with _stream_context(stream_handle):
        status = _DRIVER.cuMemcpyAsync(dst, src, size, stream_handle)
    _check("cuMemcpyAsync", status)


def copy_2d(  # noqa: PLR0913
    dst: np.ndarray, dst_pitch: np.ndarray, src: np.ndarray, src_pitch: int, width: np.ndarray, rows: int, stream_handle: int
) -> None:
    """Enqueue 2-D copies on the stream, as `copy` does: copy i moves `rows` rows of width[i] bytes, row
    j from src[i] + j * src_pitch to dst[i] + j * dst_pitch[i] (pitches up to MAX_PITCH)."""
    plan = _Memcpy2D(srcMemoryType=_UNIFIED, dstMemoryType=_UNIFIED, srcPitch=src_pitch, Height=rows)
    with _stream_context(stream_handle):
        for plan.dstDevice, plan.dstPitch, plan.srcDevice, plan.WidthInBytes in zip(
            dst.tolist(), dst_pitch.tolist(), src.tolist(), width.tolist(), strict=True
        ):
            _check("cuMemcpy2DAsync", _DRIVER.cuMemcpy2DAsync_v2(ctypes.byref(plan), stream_handle))


@contextlib.contextmanager
def _stream_context(stream_handle: int):
    """The stream's context current on this thread: the driver calls need it, and torch's device guard
    does not promise it (a fresh thread whose runtime device is already the right one gets none)."""
    context = ctypes.c_void_p()
    _check("cuStreamGetCtx", _DRIVER.cuStreamGetCtx(stream_handle, ctypes.byref(context)))
    _check("cuCtxPushCurrent", _DRIVER.cuCtxPushCurrent_v2(context))
    try:
        yield
    finally:
        _DRIVER.cuCtxPopCurrent_v2(ctypes.byref(context))


def _check(call: str, status: int) -> None:
    if status != 0:
        raise RuntimeError(f"{call} failed with CUresult {status}")
