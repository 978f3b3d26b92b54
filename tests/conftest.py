from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from daemon import DaemonProcess, new_daemon_dir, remove_daemon_dir  # noqa: E402

from kvtier.client import KVTierClient  # noqa: E402


@pytest.fixture
def start_daemon():
    """start_daemon(*args, prefix=()) starts a real kvtierd (through the `prefix` command, e.g. unshare);
    all are stopped (and checked to exit cleanly) afterwards."""
    started: list[DaemonProcess] = []

    def start(*args: str, prefix: tuple[str, ...] = ()) -> DaemonProcess:
        daemon = DaemonProcess(new_daemon_dir(), list(args), prefix=list(prefix)).start()
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        daemon.stop()
        remove_daemon_dir(daemon.directory)


@pytest.fixture
def daemon(start_daemon) -> DaemonProcess:
    return start_daemon("--pool-size", "64MiB")


@pytest.fixture
def client(daemon):
    with KVTierClient(daemon.address, engine_name="pytest") as c:
        yield c


@pytest.fixture
def fs_daemons():
    """fs_daemons(*args, directory=None, prefix=()) starts kvtierd with its filesystem tier in
    <directory>/fs; pass the directory of an earlier daemon to restart on the same files."""
    started: list[DaemonProcess] = []

    def start(*args: str, directory: Path | None = None, prefix: tuple[str, ...] = ()) -> DaemonProcess:
        directory = directory or new_daemon_dir()
        (directory / "fs").mkdir(exist_ok=True)
        fs_args = ["--pool-size", "4MiB", "--fs-path", str(directory / "fs"), "--fs-size", "64MiB", "--fs-queue-size", "64MiB"]
        fs_args += args  # (a staging queue of 64 MiB: the 1 GiB default is made ahead in every daemon)
        daemon = DaemonProcess(directory, fs_args, prefix=list(prefix)).start()
        started.append(daemon)
        return daemon

    yield start
    for daemon in started:
        daemon.stop()
    for directory in {d.directory for d in started}:
        remove_daemon_dir(directory)
