"""Assembles and runs the daemon: pool, index, gRPC services, metrics, expiry, signals, shutdown."""

from __future__ import annotations

import asyncio
import errno
import fcntl
import logging
import os
import signal
import socket
import stat
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from kvtier.v1 import kvtier_pb2 as pb
from kvtierd import __version__
from kvtierd.admin_service import AdminService
from kvtierd.block_store import BlockStore
from kvtierd.config import Config
from kvtierd.data_service import DataService
from kvtierd.data_socket import DataSocketServer
from kvtierd.errors import KVTierError
from kvtierd.fs_tier import FsSettings, FsTier
from kvtierd.gpu_transfers import GpuTransfers
from kvtierd.metrics import Metrics
from kvtierd.rpc import add_service
from kvtierd.sessions import SessionRegistry
from kvtierd.shm_pool import SharedPool, pool_file_prefix

log = logging.getLogger("kvtierd")

SHUTDOWN_GRACE_SECONDS = 5.0
_UNIX_PATH_MAX = 107
SERVICES = (pb.DESCRIPTOR.services_by_name["KVTier"], pb.DESCRIPTOR.services_by_name["KVTierAdmin"])
SERVICE_NAMES = tuple(service.full_name for service in SERVICES)


@dataclass
class Daemon:
    config: Config
    pool: SharedPool
    store: BlockStore
    sessions: SessionRegistry
    metrics: Metrics
    server: grpc.aio.Server
    health: health.aio.HealthServicer
    metrics_port: int
    data: DataService
    fs: FsTier | None
    data_socket: DataSocketServer | None
    lock: int  # the fd holding <socket>.lock


def own_directory(directory: Path, what: str, trusted: bool = False, mode: int = 0o750, private: bool = False) -> Path:
    """Create `directory` (with `mode`) or check the one there: no other user (root aside) may own
    it, or the link to it, or write in it (unless it is sticky, as /tmp): they could swap the
    daemon's socket, pool file or block files for their own, or point them elsewhere. A `private`
    one (the fs tier's, whose namespace directories have names anyone can work out) must not be
    writable by its group or by others at all, sticky or not. `trusted` (--trust-directories)
    skips the check (a directory only this pod's containers reach)."""
    if not directory.exists() and not directory.is_symlink():
        directory.mkdir(parents=True, mode=mode)
    if trusted:
        return directory
    ours = (os.geteuid(), 0)
    link, target = directory.lstat(), directory.stat()
    if link.st_uid not in ours or target.st_uid not in ours:
        raise SystemExit(f"kvtierd: {what} {directory} belongs to another user (uid {target.st_uid}); refusing to use it")
    if not stat.S_ISDIR(target.st_mode):
        raise SystemExit(f"kvtierd: {what} {directory} is not a directory")
    if target.st_mode & stat.S_IWOTH and not target.st_mode & stat.S_ISVTX:
        raise SystemExit(f"kvtierd: {what} {directory} is writable by every user; refusing to use it")
    if private and target.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise SystemExit(
            f"kvtierd: {what} {directory} is writable by other users (mode {stat.S_IMODE(target.st_mode):o}); "
            "give it a directory only the daemon's user can write"
        )
    return directory


def lock_socket(path: Path) -> int:
    """Hold `<socket>.lock` for the daemon's life: a second daemon starting on the socket at the same
    time (before either has bound it) exits instead of taking it over."""
    lock = path.with_name(path.name + ".lock")
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise SystemExit(f"kvtierd: cannot open the lock file {lock}: {exc}") from None
    if os.fstat(fd).st_uid not in (os.geteuid(), 0):
        os.close(fd)
        raise SystemExit(f"kvtierd: the lock file {lock} belongs to another user; refusing to use it")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise SystemExit(f"kvtierd: another daemon is starting or serving on {path}") from None
    return fd


def prepare_socket(path) -> None:
    """Refuse to start over a live daemon; remove a stale socket."""
    if len(str(path)) > _UNIX_PATH_MAX:
        raise SystemExit(f"kvtierd: socket path is longer than {_UNIX_PATH_MAX} bytes: {path}")
    if not path.exists() and not path.is_symlink():
        return
    if not stat.S_ISSOCK(path.lstat().st_mode):
        raise SystemExit(f"kvtierd: {path} exists and is not a socket; refusing to replace it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except OSError as exc:
        if exc.errno not in (errno.ECONNREFUSED, errno.ENOENT):
            raise SystemExit(f"kvtierd: cannot use socket {path}: {exc}") from exc
        path.unlink(missing_ok=True)
        return
    finally:
        probe.close()
    raise SystemExit(f"kvtierd: another daemon is serving on {path}")


def data_socket_path(config: Config) -> Path | None:
    """`<socket>.data` next to the gRPC socket, or None when off or when the path would be too long."""
    if not config.data_socket:
        return None
    path = config.socket.with_name(config.socket.name + ".data")
    if len(str(path)) > _UNIX_PATH_MAX:
        log.warning("data socket off: its path would be too long", extra={"path": str(path)})
        return None
    return path


def build(config: Config) -> Daemon:
    own_directory(config.socket.parent, "socket directory", config.trust_directories)
    lock = lock_socket(config.socket)
    prepare_socket(config.socket)
    fast_path = data_socket_path(config)
    if fast_path is not None:
        prepare_socket(fast_path)
    own_directory(config.shm_dir, "--shm-dir", config.trust_directories)
    stopping = {signal.SIGTERM, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, stopping)  # (a signal now would leave a half-made pool file)
    try:
        pool = SharedPool(config.shm_dir, pool_file_prefix(config.socket), config.pool_size, config.page_size, config.shm_mode)
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, stopping)
    try:
        return _build(config, pool, fast_path, lock)
    except BaseException:  # (a port in use, SIGTERM while prefaulting: no pool file or socket left behind)
        discard(config, pool, fast_path, lock)
        raise


def discard(config: Config, pool: SharedPool, fast_path: Path | None, lock: int) -> None:
    """What a start that failed made: its pool file, sockets and lock."""
    pool.close()
    for path in (config.socket, fast_path):
        if path is not None:
            path.unlink(missing_ok=True)
    os.close(lock)


def _build(config: Config, pool: SharedPool, fast_path: Path | None, lock: int) -> Daemon:
    if config.prefault:
        started = time.perf_counter()
        pool.prefault()
        log.info("pool pre-faulted", extra={"bytes": pool.size, "seconds": round(time.perf_counter() - started, 3)})
    cuda_registered = config.cuda_register and pool.register_cuda()
    store = BlockStore(
        num_pages=pool.num_pages,
        page_size=config.page_size,
        eviction=config.eviction,
        store_threshold=config.store_threshold,
        lease_ttl=config.lease_ttl,
        max_namespaces=config.max_namespaces,
        max_batch_blocks=config.max_batch_blocks,
    )
    fs = open_fs_tier(config, pool, store) if config.fs_path else None
    sessions = SessionRegistry()
    metrics = Metrics(store, sessions, fs)
    metrics_port = -1
    if config.metrics_port >= 0:
        try:
            http_server, _ = start_http_server(config.metrics_port, addr=config.metrics_host, registry=metrics.registry)
        except OSError as exc:
            raise SystemExit(f"kvtierd: cannot serve metrics on {config.metrics_host}:{config.metrics_port}: {exc}") from None
        metrics_port = http_server.server_port
    limits = pb.Limits(
        max_batch_blocks=config.max_batch_blocks,
        max_message_bytes=config.max_message_size,
        lease_ttl_ms=int(config.lease_ttl * 1000),
        max_namespaces=config.max_namespaces,
    )
    pool_info = pb.PoolInfo(
        pool_id=pool.pool_id,
        shm_path=str(pool.path),
        size_bytes=pool.size,
        page_size=pool.page_size,
        cuda_registered=cuda_registered,
    )
    info = pb.GetInfoResponse(
        version=__version__,
        pool=pool_info,
        config=config.as_strings(),
        started_at=time.time(),
        socket_path=str(config.socket),
        tcp_listen=config.listen,
        metrics_port=max(metrics_port, 0),
        limits=limits,
    )
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", config.max_message_size),
            ("grpc.max_send_message_length", config.max_message_size),
            # Notice engines that vanish without closing their connection (TCP); Unix sockets close at once.
            ("grpc.keepalive_time_ms", 10_000),
            ("grpc.keepalive_timeout_ms", 5_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
        ]
    )
    gpu = GpuTransfers(pool.address, pool.page_size, cuda_registered)
    if cuda_registered:
        gpu.warm_up()
    data = DataService(store, pool, sessions, metrics, limits, pool_info, fs, gpu, fast_path.name if fast_path else "")
    for servicer, service in zip((data, AdminService(store, pool, sessions, metrics, info, fs)), SERVICES, strict=True):
        add_service(server, servicer, service)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((*SERVICE_NAMES, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    previous_umask = os.umask(0o777 & ~config.socket_mode)  # the socket is born (here) with its final mode
    try:
        server.add_insecure_port(f"unix://{config.socket}")
    finally:
        os.umask(previous_umask)
    if config.listen:
        try:
            server.add_insecure_port(config.listen)
        except RuntimeError as exc:
            raise SystemExit(f"kvtierd: cannot listen on {config.listen}: {exc}") from None
    data_socket = DataSocketServer(data, fast_path, config.max_message_size) if fast_path else None
    return Daemon(config, pool, store, sessions, metrics, server, health_servicer, metrics_port, data, fs, data_socket, lock)


def open_fs_tier(config: Config, pool: SharedPool, store: BlockStore) -> FsTier:
    """Index the filesystem tier, register the namespaces it holds and demote the pool's victims to it."""
    settings = FsSettings(
        root=Path(config.fs_path),
        capacity=config.fs_size,
        eviction=config.fs_eviction,
        write_through=config.fs_write_through,
        io_threads=config.fs_io_threads,
        direct_io=config.fs_direct_io,
        queue_bytes=config.fs_queue_size,
        index_interval=config.fs_index_interval,
    )
    own_directory(settings.root, "--fs-path", config.trust_directories, private=True)
    fs = FsTier(settings, pool, store)
    for spec in fs.open():
        try:
            store.register(spec)
        except KVTierError as exc:  # (beyond --max-namespaces: an engine registering it later gets it back)
            log.info("fs tier namespace not registered at start", extra={"model": spec.model_id, "reason": str(exc)})
    store.on_evict = fs.on_evict
    return fs


async def expire_leases(daemon: Daemon) -> None:
    interval = min(1.0, daemon.config.lease_ttl / 4)
    while True:
        await asyncio.sleep(interval)
        leases, reservations = daemon.store.expire()
        if leases or reservations:
            log.warning("expired holds", extra={"leases": leases, "reservations": reservations})


def _stop_starting(signum, frame) -> None:
    raise SystemExit(f"kvtierd: stopped by signal {signum} while starting")


async def start(daemon: Daemon, stop: asyncio.Event) -> None:
    """Hand SIGTERM and SIGINT to the event loop (`stop`) and start serving on the sockets."""
    config = daemon.config
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    previous_umask = os.umask(0o777 & ~config.socket_mode)  # the sockets are born with their final mode
    try:
        await daemon.server.start()
        if daemon.data_socket is not None:
            await daemon.data_socket.start()
    finally:
        os.umask(previous_umask)


async def serve(config: Config) -> None:
    for signum in (signal.SIGTERM, signal.SIGINT):  # (while starting: build cleans up as it unwinds)
        signal.signal(signum, _stop_starting)
    stop, daemon = asyncio.Event(), None
    try:
        daemon = build(config)  # (which cleans up itself when it fails)
        await start(daemon, stop)
    except BaseException:  # (a signal before the loop's handlers took over, a server that did not start)
        if daemon is not None:
            discard(config, daemon.pool, daemon.data_socket.path if daemon.data_socket else None, daemon.lock)
        raise
    for name in ("", *SERVICE_NAMES):
        await daemon.health.set(name, health_pb2.HealthCheckResponse.SERVING)
    expiry = asyncio.create_task(expire_leases(daemon))
    index_file = asyncio.create_task(daemon.fs.keep_index_file()) if daemon.fs is not None else None
    log.info(
        "kvtierd serving",
        extra={
            "version": __version__,
            "socket": str(config.socket),
            "data_socket": str(daemon.data_socket.path) if daemon.data_socket else "off",
            "tcp": config.listen or "off",
            "metrics_port": daemon.metrics_port,
            "pool_bytes": daemon.pool.size,
            "pool_file": str(daemon.pool.path),
            "cuda_registered": daemon.pool.cuda is not None and daemon.pool.cuda.active,
            "eviction": config.eviction,
            "fs_path": config.fs_path or "off",
        },
    )
    await stop.wait()
    log.info("shutting down", extra={"grace_seconds": SHUTDOWN_GRACE_SECONDS})
    await daemon.health.enter_graceful_shutdown()
    if daemon.data_socket is not None:
        daemon.data_socket.close()
    daemon.data.close_sessions()
    await daemon.server.stop(SHUTDOWN_GRACE_SECONDS)
    expiry.cancel()
    daemon.data.gpu.close()
    if daemon.fs is not None:
        index_file.cancel()
        await daemon.fs.close(SHUTDOWN_GRACE_SECONDS)
    daemon.pool.close()
    config.socket.unlink(missing_ok=True)
    os.close(daemon.lock)
    log.info("stopped")
