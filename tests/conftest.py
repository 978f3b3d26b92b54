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
