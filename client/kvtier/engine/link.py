"""An engine's link to kvtierd that never hurts the engine.

Every daemon call runs on one background thread. Callers get a Future and never block on the daemon
unless they choose to wait (with a bound). When the daemon is absent, restarting or failing, calls
fail fast (their Future raises `DaemonUnavailable`), the link retries the connection at most once per
`reconnect_interval` after a failed attempt (a connect still under way is not "down": callers wait for
it like for any other answer), and after a restart it opens a new session, registers its namespace again and
maps the new pool by itself. It does so in the background too, every `reconnect_interval` while it has no
live session (a watcher thread), so an engine idle while kvtierd restarted finds it connected again,
not missing its first requests' lookups and stores. When its namespace changes (vLLM reset its prefix
cache), its next Register leaves the one before, which the daemon may then retire to make room.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from typing import TypeVar

import grpc

from kvtier.client import KVTierClient
from kvtier.ops import Namespace
from kvtier.v1 import kvtier_pb2 as pb

log = logging.getLogger("kvtier.engine")

T = TypeVar("T")


class DaemonUnavailable(Exception):
    """The daemon could not be reached, or the call failed; treat it as a miss."""


def call_error(future: Future) -> BaseException | None:
    """A done call's error (CancelledError when it was withdrawn), or None. Taken without raising it,
    and with the tracebacks of it and its causes dropped: their frames (the link thread's, which hold
    the call and so its future; the caller's, raised into) would keep the call's buffers, a store's
    block copies or a load's view of the pool, alive until a full garbage collection."""
    if future.cancelled():
        return CancelledError()
    error = future.exception()
    chained, seen = [error], set()
    while chained:
        one = chained.pop()
        if one is not None and id(one) not in seen:
            seen.add(id(one))
            one.__traceback__ = None
            chained += [one.__cause__, one.__context__]
    return error


class DaemonLink:
    def __init__(self, address: str | None, engine_name: str, timeout: float = 2.0, reconnect_interval: float = 1.0) -> None:
        self.address = address
        self.engine_name = engine_name
        self.timeout = timeout
        self.reconnect_interval = reconnect_interval
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvtier-link")
        self._client: KVTierClient | None = None
        self._spec: pb.NamespaceSpec | None = None
        self._cuda_kv: pb.CudaKVCache | None = None
        self._namespace: Namespace | None = None
        self._registered = ""  # the namespace this session registered last
        self._left = ""  # the one registered before the spec changed: the next Register leaves it
        self._down_until = 0.0  # set when a connect attempt fails: no new attempt before then
        self._down_logged = False
        self._unresponsive = False  # the last connect attempt ran out its timeout (the daemon paused, or hung)
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._reconnect_queued = threading.Event()  # a background reconnect waits on the link thread
        self.connects = 0
        threading.Thread(target=self._keep_connected, name="kvtier-link-watch", daemon=True).start()

    def set_namespace_spec(self, spec: pb.NamespaceSpec) -> None:
        """The namespace every call works in; registered on every (re)connect."""
        with self._lock:
            if self._spec is not None and self._spec == spec:
                return
            self._spec = spec
            self._left = self._registered or self._left
            self._namespace = None

    def set_cuda_kv(self, cuda_kv: pb.CudaKVCache) -> None:
        """Offer the worker's GPU KV cache (TRANSPORT_CUDA_IPC) with every registration from now on."""
        with self._lock:
            self._cuda_kv = cuda_kv
            self._namespace = None

    @property
    def cuda_registered(self) -> bool:
        """The current connection accepted the GPU KV cache (TRANSPORT_CUDA_IPC)."""
        namespace = self._namespace
        return namespace is not None and bool(namespace.cuda_registration)

    @property
    def available(self) -> bool:
        """False while the link is known to be down: its last connect attempt failed and the next is
        not due yet; or it timed out (a paused or hung daemon takes the connection and never answers),
        and none has succeeded since (the watcher retries every reconnect_interval): were the link
        taken as up between those attempts, every request's lookup would wait behind one's timeout.
        Meanwhile only the watcher tries to connect. A daemon that refuses at once (gone, restarting)
        is tried again by the first call after the down window."""
        return self._client is not None or (not self._unresponsive and time.monotonic() >= self._down_until)

    def submit(self, call: Callable[[KVTierClient, Namespace], T]) -> Future[T]:
        """Run `call(client, namespace)` on the link thread; its Future raises DaemonUnavailable on failure
        (take a done one's error with `call_error`, not by raising it)."""
        return self._executor.submit(self._run, call)

    def _run(self, call: Callable[[KVTierClient, Namespace], T]) -> T:
        try:
            client, namespace = self._connected()
            return call(client, namespace)
        except grpc.RpcError as exc:
            code = exc.code()
            answered = getattr(exc, "answered", False)  # (the data socket's: a copy refused for its deadline)
            lost = code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED) and not answered
            if lost or code == grpc.StatusCode.UNAUTHENTICATED:
                self._drop(f"{code.name}: {exc.details()}")
            raise DaemonUnavailable(f"{code.name}: {exc.details()}") from None
        except (OSError, ValueError) as exc:
            self._drop(str(exc))
            raise DaemonUnavailable(str(exc)) from exc

    def connect_soon(self, map_pool: bool) -> None:
        """Open the session in the background now, so the first real call finds it ready; with
        `map_pool` (an engine that copies through the pool: shm), map all of the pool too, so copies
        take no page faults. Others never touch it (a scheduler; a GPU worker whose copies the daemon
        makes), and mapping a large pool costs each process its page tables (about 2 MiB a GiB) and
        its link thread seconds."""

        def connect() -> None:
            try:
                session = self._session()
                if map_pool:
                    session.state.pool().populate()
            except (DaemonUnavailable, OSError):
                pass

        self._executor.submit(connect)

    def _keep_connected(self) -> None:
        """Every reconnect_interval until closed: with no live session (lost, or never opened because
        the daemon was absent), queue a reconnect on the link thread (at most one at a time)."""
        while not self._closing.wait(self.reconnect_interval):
            client = self._client
            if (client is not None and client.connected) or self._reconnect_queued.is_set():
                continue
            self._reconnect_queued.set()
            try:
                self._executor.submit(self._reconnect)
            except RuntimeError:  # shut down
                return

    def _reconnect(self) -> None:
        """The watcher's attempt. It paces the retries itself, so it neither waits out the down window
        nor extends it: the window is the calls' (after a call failed, the next ones skip the daemon
        for reconnect_interval), and a call that comes right after the daemon is back, while the link
        was idle, connects at once instead of being skipped because of a background attempt."""
        calls_down_until, self._down_until = self._down_until, 0.0
        try:
            self._connected(retry=True)
        except DaemonUnavailable:
            if self._client is None:  # (else connected, with no namespace to register yet)
                self._down_until = calls_down_until
        finally:  # (one attempt at a time: against a paused daemon each lasts the timeout)
            self._reconnect_queued.clear()

    def _connected(self, retry: bool = False) -> tuple[KVTierClient, Namespace]:
        """The session and namespace, connecting and registering as needed (`retry`: the watcher's
        attempt, made even while the daemon is not answering)."""
        client = self._session(retry)
        with self._lock:
            spec, namespace, cuda_kv, left = self._spec, self._namespace, self._cuda_kv, self._left
        if spec is None:
            raise DaemonUnavailable("no namespace registered yet")
        if namespace is None:
            try:
                namespace = client.register(spec, cuda_kv, replaces=left)
                if cuda_kv is not None and not namespace.cuda_registration:
                    log.warning("kvtierd refused cuda_ipc (%s); the engine copies through shared memory", namespace.cuda_refused)
                    self._executor.submit(_map_pool_for_gpu_copies, client)
            except (grpc.RpcError, ValueError) as exc:  # (ValueError: an answer not to act on)
                reason = f"{exc.code().name}: {exc.details()}" if isinstance(exc, grpc.RpcError) else str(exc)
                self._drop(f"register failed: {reason}")
                self._down_until = time.monotonic() + self.reconnect_interval  # (not a new session per call)
                raise DaemonUnavailable(reason) from None
            with self._lock:
                self._registered = namespace.id
                if self._spec == spec:
                    self._namespace, self._left = namespace, ""
                else:  # the spec changed meanwhile: the next Register leaves this one
                    self._left = namespace.id
        return client, namespace

    def _session(self, retry: bool = False) -> KVTierClient:
        client = self._client
        if client is not None and not client.connected:
            self._drop("session ended")
            client = None
        if client is None:
            if self._closing.is_set():  # (a call or reconnect queued before close must not open a session)
                raise DaemonUnavailable("the link is closed")
            if time.monotonic() < self._down_until or (self._unresponsive and not retry):
                raise DaemonUnavailable("kvtierd unreachable; retrying shortly")
            started = time.monotonic()
            try:
                client = KVTierClient(self.address, engine_name=self.engine_name, timeout=self.timeout).connect()
            except (grpc.RpcError, ConnectionError, OSError) as exc:
                self._down_until = time.monotonic() + self.reconnect_interval
                # (gRPC's own connect timeout or ours, whichever fired first: a daemon that took the
                # connection and never answered, not one that refused it)
                self._unresponsive = time.monotonic() - started >= 0.9 * self.timeout
                if not self._down_logged:
                    log.warning("kvtierd unreachable (%s); serving without it (misses) and retrying", exc)
                    self._down_logged = True
                raise DaemonUnavailable(str(exc)) from None
            self._client = client
            self._down_logged = self._unresponsive = False
            self.connects += 1
            log.info("connected to kvtierd at %s (session %s)", client.address, client.state.session_id)
        return client

    def _drop(self, reason: str, expected: bool = False) -> None:
        client, self._client = self._client, None
        with self._lock:
            self._namespace = None
            self._registered = self._left = ""  # (the next session has registered none)
        if client is not None:
            if not expected:
                log.warning("lost kvtierd (%s); serving without it until it is back", reason)
            try:
                client.close()
            except Exception:  # noqa: BLE001 (closing a broken client must not raise)
                pass

    def close(self) -> None:
        """End the session and stop the link (again: nothing more)."""
        if self._closing.is_set():
            return
        self._closing.set()
        try:
            self._executor.submit(self._drop, "engine shutting down", True).result(timeout=5)
        except (RuntimeError, TimeoutError):  # the interpreter is exiting (vLLM shuts connectors down from a
            self._drop("engine shutting down", expected=True)  # finalizer), or the link thread is stuck in a call
        finally:
            self._executor.shutdown(wait=False, cancel_futures=True)


def _map_pool_for_gpu_copies(client: KVTierClient) -> None:
    """A GPU worker the daemon refused cuda_ipc copies through the pool itself: its mapping of the
    pool, populated and registered with CUDA, is made now, on the link thread after the registration,
    instead of inside its first copy call (seconds for a large pool, against that call's deadline)."""
    try:
        client.state.pool().cuda_address()
    except Exception:  # noqa: BLE001 (the copies try again, and fail as misses)
        log.warning("kvtier cannot register the pool with CUDA; the engine's copies will fail", exc_info=True)
