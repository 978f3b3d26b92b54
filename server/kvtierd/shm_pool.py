"""The daemon's shared-memory pool: one file under --shm-dir, mapped, pre-faulted and optionally pinned."""

from __future__ import annotations

import hashlib
import logging
import mmap
import os
import stat
import sys
import uuid
from pathlib import Path

import numpy as np

from kvtier.cuda_host import CudaHostRegistration
from kvtier.pool_view import PageView

log = logging.getLogger(__name__)

_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_PREFAULT_CHUNK = 256 << 20
_PROGRESS_MIN_BYTES = 4 << 30


def pool_file_prefix(socket_path: Path) -> str:
    """Pool files of one daemon identity (its socket) share this prefix; stale ones are removed at start."""
    return "kvtierd-" + hashlib.sha256(str(socket_path).encode()).hexdigest()[:12] + "-"


class SharedPool:
    def __init__(self, shm_dir: Path, prefix: str, size: int, page_size: int, mode: int) -> None:
        self.pool_id = uuid.uuid4().hex
        self.size = size // page_size * page_size
        self.page_size = page_size
        shm_dir.mkdir(parents=True, exist_ok=True)
        for stale in shm_dir.glob(prefix + "*"):
            _remove_stale(stale)
        fs = os.statvfs(shm_dir)
        if fs.f_bavail * fs.f_frsize < self.size:
            raise SystemExit(
                f"kvtierd: {shm_dir} has {fs.f_bavail * fs.f_frsize} bytes free, less than the pool's {self.size}; "
                "lower --pool-size or enlarge the tmpfs (containers: --shm-size)"
            )
        self.path = shm_dir / f"{prefix}{self.pool_id[:12]}.pool"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, mode)
        try:
            os.fchmod(fd, mode)
            os.ftruncate(fd, self.size)
            self._mmap = mmap.mmap(fd, self.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self._array = np.frombuffer(self._mmap, dtype=np.uint8)
        self.view = PageView(self._mmap, page_size)
        self.cuda: CudaHostRegistration | None = None

    @property
    def num_pages(self) -> int:
        return self.size // self.page_size

    def prefault(self) -> None:
        """Allocate every page now (with a progress bar for large pools) so no fault happens later."""
        show_progress = self.size >= _PROGRESS_MIN_BYTES and sys.stderr.isatty()
        bar = None
        if show_progress:
            from tqdm import tqdm  # noqa: PLC0415

            bar = tqdm(total=self.size, unit="B", unit_scale=True, unit_divisor=1024, desc="pre-faulting pool")
        for start in range(0, self.size, _PREFAULT_CHUNK):
            length = min(_PREFAULT_CHUNK, self.size - start)
            try:
                self._mmap.madvise(_MADV_POPULATE_WRITE, start, length)
            except OSError:
                self._array[start : start + length : 4096] = 0
            if bar is not None:
                bar.update(length)
            elif self.size >= _PROGRESS_MIN_BYTES and (start // _PREFAULT_CHUNK) % 16 == 0:
                log.info("pre-faulting pool", extra={"done_bytes": start + length, "total_bytes": self.size})
        if bar is not None:
            bar.close()

    @property
    def address(self) -> int:
        """Where the pool is mapped in this process (also its device address once registered with CUDA)."""
        return self._array.ctypes.data

    def register_cuda(self) -> bool:
        self.cuda = CudaHostRegistration(self.address, self.size)
        return self.cuda.active

    def close(self) -> None:
        if self.cuda is not None:
            self.cuda.close()
        self.path.unlink(missing_ok=True)
        self.view = None  # type: ignore[assignment]
        self._array = None  # type: ignore[assignment]
        try:
            self._mmap.close()
        except BufferError:
            pass


def _remove_stale(path: Path) -> None:
    """Remove a pool file a daemon of this socket left (it died); anything else of that name (another
    user's file, a directory, put there in a sticky /dev/shm) is left alone, with a warning: the
    daemon starts all the same (its own pool file has a new name)."""
    try:
        info = path.lstat()
    except FileNotFoundError:
        return
    if not (stat.S_ISREG(info.st_mode) or stat.S_ISLNK(info.st_mode)) or info.st_uid != os.geteuid():
        log.warning("not removing a file named like a stale pool file: not ours", extra={"path": str(path), "uid": info.st_uid})
        return
    log.info("removing stale pool file", extra={"path": str(path)})
    try:
        path.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("cannot remove a stale pool file", extra={"path": str(path), "reason": str(exc)})
