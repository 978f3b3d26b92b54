"""Start-up defaults, permissions, metrics, TCP opt-in, stale state and graceful shutdown."""

import fcntl
import os
import re
import resource
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from blocks import chain_hashes, contents, spec
from daemon import DaemonProcess, new_daemon_dir, remove_daemon_dir

from kvtier.client import KVTierClient
from kvtierd.server import SHUTDOWN_GRACE_SECONDS


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_socket_and_pool_permissions(daemon):
    assert stat.S_IMODE(daemon.socket.stat().st_mode) == 0o660
    pool_files = list(daemon.shm_dir.iterdir())
    assert len(pool_files) == 1
    assert stat.S_IMODE(pool_files[0].stat().st_mode) == 0o600
    assert pool_files[0].stat().st_size == 64 << 20


def test_group_shared_pool_mode(start_daemon):
    daemon = start_daemon("--pool-size", "16MiB", "--shm-mode", "0660", "--socket-mode", "0600")
    assert stat.S_IMODE(next(daemon.shm_dir.iterdir()).stat().st_mode) == 0o660
    assert stat.S_IMODE(daemon.socket.stat().st_mode) == 0o600
    data_socket = daemon.socket.with_name(daemon.socket.name + ".data")  # the same door: the same mode
    assert stat.S_ISSOCK(data_socket.stat().st_mode) and stat.S_IMODE(data_socket.stat().st_mode) == 0o600


def test_a_socket_directory_the_daemon_creates_is_0750(tmp_path):
    from kvtierd.server import own_directory  # noqa: PLC0415

    previous = os.umask(0o002)  # (a umask that would let a looser mode through)
    try:
        own_directory(tmp_path / "run", "socket directory")
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "run").stat().st_mode) == 0o750


def test_metrics_endpoint(daemon):
    with KVTierClient(daemon.address) as client:
        ns = client.register(spec())
        hashes = chain_hashes("m", 3)
        client.store(ns, hashes, contents(hashes, ns.block_bytes))
        client.load(ns, hashes)
        client.lookup(ns, chain_hashes("absent", 2))
        port = daemon.admin("GetInfo").metrics_port
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    assert values['kvtierd_stored_blocks_total{tier="ram"}'] == 3
    assert values['kvtierd_stored_bytes_total{tier="ram"}'] == 3 * ns.block_bytes
    assert values['kvtierd_loaded_blocks_total{tier="ram"}'] == 3
    assert values['kvtierd_hit_blocks_total{tier="ram"}'] == 3
    assert values['kvtierd_miss_blocks_total{tier="ram"}'] == 2
    assert values["kvtierd_lookup_requests_total"] == 2
    assert values['kvtierd_tier_capacity_bytes{tier="ram"}'] == 64 << 20
    assert values['kvtierd_tier_used_bytes{tier="ram"}'] == 3 * 3 * 32768
    assert values["kvtierd_engines_connected"] == 1
    assert values['kvtierd_rpc_duration_seconds_count{method="Lookup"}'] >= 1
    for name in ("kvtierd_evicted_blocks_total", "kvtierd_reserved_bytes", "kvtierd_pinned_blocks", "kvtierd_rpc_errors_total"):
        assert name in text


def test_tcp_only_when_asked(start_daemon):
    port = free_port()
    quiet = start_daemon("--pool-size", "16MiB")
    assert str(port) not in quiet.admin("GetInfo").tcp_listen
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0
    start_daemon("--pool-size", "16MiB", "--listen", f"127.0.0.1:{port}")
    with KVTierClient(f"127.0.0.1:{port}") as client:
        assert client.register(spec()).id


@pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs prlimit (util-linux)")
def test_the_open_files_limit_goes_up_to_the_hard_one(start_daemon):
    """Connections of many engines and the fs tier's files must not run out of descriptors at the
    common soft limit of 1024: the daemon raises its soft limit to the hard one."""
    hard = min(resource.getrlimit(resource.RLIMIT_NOFILE)[1], 4096)
    daemon = start_daemon(prefix=("prlimit", f"--nofile=256:{hard}"))
    limits = Path(f"/proc/{daemon.process.pid}/limits").read_text()
    assert re.search(rf"^Max open files\s+{hard}\s+{hard}\s", limits, re.M), limits
    assert f"open files limit raised from=256 to={hard}" in daemon.log()


def test_second_daemon_on_the_same_socket_is_refused(daemon):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvtierd",
            "--socket",
            str(daemon.socket),
            "--shm-dir",
            str(daemon.shm_dir),
            "--metrics-port",
            "-1",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode != 0 and "another daemon is starting or serving" in result.stderr
    assert daemon.admin("GetStats").tiers[0].capacity_bytes == 64 << 20  # the first one is untouched


def test_stale_socket_and_pool_files_from_a_crash_are_cleaned(start_daemon):
    crashed = start_daemon("--pool-size", "16MiB")
    crashed.stop(sig=9)
    assert crashed.socket.exists() and len(list(crashed.shm_dir.iterdir())) == 1
    restarted = DaemonProcess(crashed.directory, crashed.args).start()
    try:
        assert len(list(restarted.shm_dir.iterdir())) == 1  # the old pool file is gone
        with KVTierClient(restarted.address) as client:
            assert client.register(spec()).id
    finally:
        assert restarted.stop() == 0


def test_graceful_shutdown_with_work_in_flight():
    daemon = DaemonProcess(new_daemon_dir(), ["--pool-size", "16MiB"]).start()
    try:
        client = KVTierClient(daemon.address).connect()
        ns = client.register(spec())
        client.reserve(ns, chain_hashes("in-flight", 4))
        client.store(ns, chain_hashes("done", 2), contents(chain_hashes("done", 2), ns.block_bytes))
        client.lookup(ns, chain_hashes("done", 2), pin=True)
        started = time.monotonic()
        assert daemon.stop() == 0
        assert time.monotonic() - started < SHUTDOWN_GRACE_SECONDS - 0.5  # open sessions are ended, not waited out
        assert not daemon.socket.exists()
        assert list(daemon.shm_dir.iterdir()) == []
        log = daemon.log()
        assert "shutting down" in log and "stopped" in log and "aborted_reservations=1" in log
        deadline = time.monotonic() + 5  # (the client's watcher thread sees the stream end)
        while client.connected:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        client.close()
    finally:
        remove_daemon_dir(daemon.directory)


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_structured_logs(start_daemon, fmt):
    import json

    daemon = start_daemon("--pool-size", "16MiB", "--log-format", fmt)
    first = daemon.log().splitlines()[0]
    if fmt == "json":
        entry = json.loads(first)
        assert entry["level"] == "info" and "msg" in entry
    else:
        assert " info " in first


def test_a_file_that_is_not_a_socket_is_never_replaced(tmp_path):
    victim = tmp_path / "precious.txt"
    victim.write_text("keep me")
    result = subprocess.run(
        [sys.executable, "-m", "kvtierd", "--socket", str(victim), "--pool-size", "16MiB", "--metrics-port", "-1"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode != 0 and "is not a socket" in result.stderr
    assert victim.read_text() == "keep me"


def test_a_pool_larger_than_the_tmpfs_is_refused(monkeypatch, tmp_path):
    import os

    from kvtierd.shm_pool import SharedPool

    real = os.statvfs(tmp_path)
    tiny = os.statvfs_result((real.f_bsize, 4096, 100, 10, 10, *real[5:]))
    monkeypatch.setattr(os, "statvfs", lambda path: tiny)
    with pytest.raises(SystemExit, match="--shm-size"):
        SharedPool(tmp_path, "kvtierd-test-", 1 << 20, 4096, 0o600)
    assert list(tmp_path.iterdir()) == []


@pytest.fixture
def shm(tmp_path):
    """A directory of the test's own under /dev/shm for the pool file."""
    directory = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="kvt-life-"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def start_args(tmp_path, shm, *args: str) -> list[str]:
    """A daemon on tmp_path/k.sock with its pool file in `shm`."""
    return [sys.executable, "-m", "kvtierd", "--socket", str(tmp_path / "k.sock"), "--shm-dir", str(shm), *args]


def run_to_end(argv: list[str]) -> subprocess.CompletedProcess:
    """A daemon start expected to end by itself (refused), without a metrics port."""
    return subprocess.run([*argv, "--metrics-port", "-1"], capture_output=True, text=True, timeout=60)


def leftovers(tmp_path, shm) -> list[str]:
    """Pool files and sockets a daemon left (the lock file may stay)."""
    return sorted(p.name for p in [*shm.iterdir(), *tmp_path.iterdir()] if not p.name.endswith(".lock"))


@pytest.mark.parametrize("place", ["--socket directory", "--shm-dir", "--fs-path"])
def test_a_directory_every_user_may_write_in_is_refused(tmp_path, shm, place):
    """Another user could swap the daemon's socket, pool file or block files in it for their own
    (or plant blocks the daemon would serve as genuine)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    args = {
        "--socket directory": ["--socket", str(shared / "k.sock")],
        "--shm-dir": ["--shm-dir", str(shared)],
        "--fs-path": ["--fs-path", str(shared), "--fs-size", "64MiB"],
    }[place]
    result = subprocess.run(
        [*start_args(tmp_path, shm, "--pool-size", "16MiB", "--metrics-port", "-1"), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0 and "writable by every user; refusing to use it" in result.stderr, result.stderr
    assert leftovers(tmp_path, shm) == ["shared"] and list(shared.iterdir()) == []  # (no pool file or socket left)


def test_trust_directories_lets_a_directory_every_user_may_write_in_be_used(tmp_path, shm):
    """--trust-directories: a Kubernetes emptyDir is 0777 (only the pod's containers reach it)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    command = [*start_args(tmp_path, shm, "--pool-size", "16MiB", "--metrics-port", "-1")]
    command[command.index("--socket") + 1] = str(shared / "k.sock")
    daemon = subprocess.Popen([*command, "--trust-directories", "true"], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while not (shared / "k.sock").exists() and daemon.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (shared / "k.sock").exists(), daemon.stderr.read() if daemon.poll() is not None else "no socket"
    finally:
        daemon.terminate()
        daemon.wait(timeout=30)


@pytest.mark.skipif(os.geteuid() != 0, reason="gives a file to another user")
def test_a_lock_file_another_user_made_is_refused_with_a_message(tmp_path, shm):
    """In a sticky shared directory (as /tmp) another user can make <socket>.lock first."""
    lock = tmp_path / "k.sock.lock"
    lock.touch(mode=0o666)
    os.chown(lock, 65534, 65534)
    command = start_args(tmp_path, shm, "--pool-size", "16MiB", "--metrics-port", "-1")
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "belongs to another user" in result.stderr and "Traceback" not in result.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="gives a directory to another user")
def test_a_socket_directory_another_user_made_is_refused(tmp_path):
    """As /tmp/kvtierd-<uid> made in advance by another local user, who could then move the socket away."""
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o755)
    os.chown(theirs, 65534, 65534)
    result = run_to_end([sys.executable, "-m", "kvtierd", "--socket", str(theirs / "k.sock"), "--pool-size", "16MiB"])
    assert result.returncode != 0 and "belongs to another user" in result.stderr, result.stderr
    assert list(theirs.iterdir()) == []


def test_a_daemon_starting_while_another_starts_on_the_socket_exits(tmp_path, shm):
    """Both would pass the live-socket check before either bound the socket, then take it (and each
    other's pool file) over: the lock on <socket>.lock lets one in."""
    held = os.open(tmp_path / "k.sock.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(held, fcntl.LOCK_EX)  # (the other daemon, still prefaulting its pool)
    try:
        result = subprocess.run(
            start_args(tmp_path, shm, "--pool-size", "16MiB", "--metrics-port", "-1"), capture_output=True, text=True, timeout=60
        )
    finally:
        os.close(held)
    assert result.returncode != 0 and "another daemon is starting or serving" in result.stderr, result.stderr
    assert leftovers(tmp_path, shm) == []


def test_a_start_that_fails_leaves_no_pool_file_or_socket(tmp_path, shm):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = subprocess.run(
            start_args(tmp_path, shm, "--pool-size", "16MiB", "--metrics-port", str(port)),
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode != 0 and f"cannot serve metrics on 127.0.0.1:{port}" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and leftovers(tmp_path, shm) == []


@pytest.mark.skipif(shutil.disk_usage("/dev/shm").free < 4 << 30, reason="needs 4 GiB free in /dev/shm")
def test_sigterm_while_starting_leaves_no_pool_file(tmp_path, shm):
    """SIGTERM while a large pool is prefaulted: the daemon exits and takes its pool file with it."""
    process = subprocess.Popen(
        start_args(tmp_path, shm, "--pool-size", "3GiB", "--metrics-port", "-1"), stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 30
    while not any(shm.glob("*.pool")) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert any(shm.glob("*.pool")), "the pool file never appeared"
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode != 0 and "stopped by signal" in stderr, stderr
    assert leftovers(tmp_path, shm) == []


@pytest.mark.parametrize("mode", [0o1777, 0o770])
def test_an_fs_path_others_may_write_in_is_refused_even_sticky(tmp_path, shm, mode):
    """The fs tier's namespace directories have names anyone can work out (digests of engines' specs):
    in a sticky /tmp-like directory, or one its group may write, another user could make them first
    (and swap block files for links to files the daemon would then write over)."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    result = run_to_end(start_args(tmp_path, shm, "--pool-size", "16MiB", "--fs-path", str(shared), "--fs-size", "64MiB"))
    assert result.returncode != 0 and "writable by other users" in result.stderr, result.stderr
    assert list(shared.iterdir()) == []


def test_what_the_daemon_makes_is_not_writable_by_others_whatever_its_umask(tmp_path, shm):
    """Started with umask 000, the daemon still makes its directories 0750 and files at most 0640 (the
    fs tier's directories were 0777: anyone could swap block files for links)."""
    fs_root = tmp_path / "fs"
    args = start_args(tmp_path, shm, "--pool-size", "16MiB", "--metrics-port", "-1", "--socket", str(tmp_path / "run" / "k.sock"))
    args += ["--fs-path", str(fs_root), "--fs-size", "64MiB", "--fs-write-through", "true"]
    daemon = subprocess.Popen(args, preexec_fn=lambda: os.umask(0), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "run" / "k.sock").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        with KVTierClient(f"unix://{tmp_path / 'run' / 'k.sock'}") as client:
            ns = client.register(spec(block_bytes=4096))
            hashes = chain_hashes("umask", 1)
            client.store(ns, hashes, contents(hashes, 4096))
            deadline = time.monotonic() + 20
            while not list(fs_root.rglob("*.kvb")) and time.monotonic() < deadline:
                time.sleep(0.05)
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(30)
    made = [tmp_path / "run", fs_root, *fs_root.rglob("*")]
    assert len(made) > 20  # (the namespace's directories, spec file, block file, index file)
    for path in made:
        allowed = 0o750 if path.is_dir() else 0o640
        assert stat.S_IMODE(path.lstat().st_mode) & ~allowed == 0, f"{path}: {stat.S_IMODE(path.lstat().st_mode):o}"


def test_something_else_named_like_a_stale_pool_file_does_not_stop_the_daemon(tmp_path, shm):
    """Anyone can make a file or directory named like the daemon's pool files in a sticky /dev/shm (the
    prefix comes from the socket path): the daemon leaves what is not its own file and starts (it
    exited when it could not remove it)."""
    from kvtierd.shm_pool import pool_file_prefix

    planted = shm / (pool_file_prefix(tmp_path / "k.sock") + "planted.pool")
    planted.mkdir()
    daemon = subprocess.Popen(start_args(tmp_path, shm, "--pool-size", "16MiB", "--metrics-port", "-1"), stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "k.sock").exists() and daemon.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert daemon.poll() is None and (tmp_path / "k.sock").exists() and planted.is_dir()
    finally:
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(30) == 0
