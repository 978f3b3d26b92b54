"""DMA copies through the CUDA driver: batches of flat runs in one cuMemcpyBatchAsync, batches of 2-D
copies (rows of one width at a pitch) in one cuMemcpy3DBatchAsync (their CUDA 13 forms, the _v2
symbols without failIdx: drivers of CUDA 13 and later; with an older driver `available()` is False
and every copy takes the kernel), and single copies (cuMemcpyAsync).

The copy engines move host<->device bytes at the full PCIe rate (about 0.98 of a bulk memcpy on an
H200 for runs of 1 MiB or more), where a kernel reading or writing host memory reaches about 0.92.
Each copy has a fixed cost in the driver and the engine (a 2-D copy about 3 us of the copy engines'
time beyond its bytes, measured on an H200), so small copies (the 32 KiB pages of a scattered pool,
the 64 KiB layers of a few blocks) go slower than the kernel: gpu_copy picks DMA only for large ones.
A batch is one ctypes call, its arrays filled by numpy (no Python loop or object per copy).
"""

from __future__ import annotations

import contextlib
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
    """libcuda with cuMemcpyBatchAsync and cuMemcpy3DBatchAsync as CUDA 13 declares them (no failIdx),
    or None on older drivers or without CUDA."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
        batch = driver.cuMemcpyBatchAsync_v2
        driver.cuMemcpy3DBatchAsync_v2  # noqa: B018 (present, or AttributeError)
    except (OSError, AttributeError):
        return None
    pointer, size = ctypes.c_void_p, ctypes.c_size_t
    batch.argtypes = [pointer, pointer, pointer, size, pointer, pointer, size, pointer]  # dsts .. numAttrs, stream
    driver.cuStreamGetCtx.argtypes = [pointer, ctypes.POINTER(pointer)]
    driver.cuCtxPushCurrent_v2.argtypes = [pointer]
    driver.cuCtxPopCurrent_v2.argtypes = [ctypes.POINTER(pointer)]
    driver.cuMemcpy3DBatchAsync_v2.argtypes = [size, pointer, ctypes.c_ulonglong, pointer]  # numOps, opList, flags, stream
    driver.cuMemcpyAsync.argtypes = [ctypes.c_uint64, ctypes.c_uint64, size, pointer]
    return driver


_DRIVER = _driver()
_IN_STREAM_ORDER = _MemcpyAttributes(_SRC_ACCESS_ORDER_STREAM, _MemLocation(), _MemLocation(), 0)
_FIRST_COPY = (ctypes.c_size_t * 1)(0)
MAX_PITCH = (1 << 31) - 1  # the driver's limit on a 2-D copy's pitch (CU_DEVICE_ATTRIBUTE_MAX_PITCH)

# A CUDA_MEMCPY3D_BATCH_OP (112 bytes) as 14 64-bit words: source operand (type, ptr, rowLength,
# layerHeight, locHint), destination operand (the same), extent (width, height, depth), then
# srcAccessOrder and flags (two 32-bit fields, little-endian) in the last word.
_OP_WORDS = 14
_SRC_PTR, _SRC_PITCH, _DST_PTR, _DST_PITCH, _WIDTH, _ROWS = 1, 2, 6, 7, 10, 11
_ONES = [0, 5, 12, 13]  # CU_MEMCPY_OPERAND_TYPE_POINTER twice, depth 1, CU_MEMCPY_SRC_ACCESS_ORDER_STREAM (flags 0)


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
    """Enqueue 2-D copies on the stream in one driver call, as `copy` does: copy i moves `rows` rows of
    width[i] bytes, row j from src[i] + j * src_pitch to dst[i] + j * dst_pitch[i] (pitches up to
    MAX_PITCH)."""
    ops = np.zeros((len(width), _OP_WORDS), dtype=np.uint64)
    ops[:, _ONES] = 1
    ops[:, _SRC_PTR], ops[:, _SRC_PITCH] = src, src_pitch
    ops[:, _DST_PTR], ops[:, _DST_PITCH] = dst, dst_pitch
    ops[:, _WIDTH], ops[:, _ROWS] = width, rows
    with _stream_context(stream_handle):
        status = _DRIVER.cuMemcpy3DBatchAsync_v2(len(ops), ops.ctypes.data, 0, stream_handle)
    _check("cuMemcpy3DBatchAsync", status)


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
