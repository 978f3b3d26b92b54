"""XXH3-64 of byte buffers, hashed without holding the GIL where the system has libxxhash.

python-xxhash holds the GIL while it hashes (about 0.15 ms per 2 MiB block), so the filesystem
tier's I/O threads, which hash every block they write and read, took turns for it. The same function
of the system's libxxhash (Debian/Ubuntu `libxxhash0`), called through ctypes, lets the GIL go while
it runs. Both give the same values; python-xxhash is used where the library is missing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Sequence

import numpy as np
import xxhash


def _library() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("xxhash")
    if name is None:
        return None
    try:
        library = ctypes.CDLL(name)
        functions = (
            library.XXH3_64bits,
            library.XXH3_createState,
            library.XXH3_freeState,
            library.XXH3_64bits_reset,
            library.XXH3_64bits_update,
            library.XXH3_64bits_digest,
        )
    except (OSError, AttributeError):
        return None
    one_shot, create, free, reset, update, digest = functions
    one_shot.argtypes, one_shot.restype = [ctypes.c_void_p, ctypes.c_size_t], ctypes.c_uint64
    create.argtypes, create.restype = [], ctypes.c_void_p
    free.argtypes, free.restype = [ctypes.c_void_p], ctypes.c_int
    reset.argtypes, reset.restype = [ctypes.c_void_p], ctypes.c_int
    update.argtypes, update.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t], ctypes.c_int
    digest.argtypes, digest.restype = [ctypes.c_void_p], ctypes.c_uint64
    return library


_LIBRARY = _library()


def releases_gil() -> bool:
    """Whether hashing goes through libxxhash (the GIL is let go) rather than python-xxhash."""
    return _LIBRARY is not None


def xxh3_64(segments: Sequence) -> int:
    """The XXH3-64 (seed 0) of the segments' bytes one after another; each segment a contiguous buffer."""
    if _LIBRARY is None:
        hasher = xxhash.xxh3_64()
        for segment in segments:
            hasher.update(segment)
        return hasher.intdigest()
    arrays = [np.frombuffer(segment, dtype=np.uint8) for segment in segments]
    if len(arrays) == 1:
        return _LIBRARY.XXH3_64bits(arrays[0].ctypes.data, arrays[0].nbytes)
    state = _LIBRARY.XXH3_createState()
    if not state:
        raise MemoryError("XXH3_createState failed")
    try:
        _LIBRARY.XXH3_64bits_reset(state)
        for array in arrays:
            _LIBRARY.XXH3_64bits_update(state, array.ctypes.data, array.nbytes)
        return _LIBRARY.XXH3_64bits_digest(state)
    finally:
        _LIBRARY.XXH3_freeState(state)
