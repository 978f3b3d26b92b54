"""Optional pinning of the pool with cudaHostRegister, so GPU copies to and from it run at PCIe speed."""

from __future__ import annotations

import ctypes
import logging
import os

log = logging.getLogger(__name__)

_CUDA_HOST_REGISTER_PORTABLE = 1
_CUDA_HOST_REGISTER_MAPPED = 2  # kernels read and write it at its host address (unified addressing)
_LIBCUDART_NAMES = ("libcudart.so", "libcudart.so.13", "libcudart.so.12")


class CudaHostRegistration:
    """Registers [address, address+size) with CUDA; `active` tells whether it took effect."""

    def __init__(self, address: int, size: int) -> None:
        self.address = address
        self.active = False
        self._cudart = _find_cudart()
        if self._cudart is None:
            return
        status = self._cudart.cudaHostRegister(
            ctypes.c_void_p(address), ctypes.c_size_t(size), _CUDA_HOST_REGISTER_PORTABLE | _CUDA_HOST_REGISTER_MAPPED
        )
        if status != 0:
            log.warning("cudaHostRegister failed", extra={"cuda_status": int(status), "bytes": size})
            return
        self.active = True

    def close(self) -> None:
        if self.active:
            self._cudart.cudaHostUnregister(ctypes.c_void_p(self.address))
            self.active = False


def _find_cudart():
    if not any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/nvidia0")):
        return None
    try:
        import torch  # noqa: PLC0415 (only where a GPU exists)

        if torch.cuda.is_available():
            torch.cuda.init()
            return _CudartFromTorch(torch.cuda.cudart())
    except ImportError:
        pass
    for name in _LIBCUDART_NAMES:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    log.info("CUDA device present but no CUDA runtime found; the pool is not pinned")
    return None


class _CudartFromTorch:
    """Adapts torch's cudart bindings to the ctypes call signature used above."""

    def __init__(self, cudart) -> None:
        self._cudart = cudart

    def cudaHostRegister(self, ptr, size, flags):  # noqa: N802 (CUDA's name)
        return int(self._cudart.cudaHostRegister(ptr.value, size.value, flags))

    def cudaHostUnregister(self, ptr):  # noqa: N802
        return int(self._cudart.cudaHostUnregister(ptr.value))
