"""Starts the real kvtierd as a subprocess on a private Unix socket and pool, for integration tests."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtier.v1 import kvtier_pb2 as pb
from kvtier.v1 import kvtier_pb2_grpc as pb_grpc

START_TIMEOUT = 20.0


@dataclass
class DaemonProcess:
    directory: Path
    args: list[str]
    prefix: list[str] = field(default_factory=list)  # runs the daemon through this command (e.g. unshare)
    start_timeout: float = START_TIMEOUT  # (a pool of many GiB takes longer to touch and pin)
    process: subprocess.Popen | None = None
    log_path: Path = field(init=False)

    def __post_init__(self) -> None:
        self.log_path = self.directory / "kvtierd.log"

    @property
    def socket(self) -> Path:
        return self.directory / "kvtierd.sock"

    @property
    def address(self) -> str:
        return f"unix://{self.socket}"

    @property
    def shm_dir(self) -> Path:
        # tmpfs, as in production: a pool file on a disk filesystem is slow and cannot be CUDA-registered
        return Path("/dev/shm") / self.directory.name

    def start(self) -> DaemonProcess:
        self.shm_dir.mkdir(exist_ok=True)
        command = [
            *self.prefix,
            sys.executable,
            "-m",
            "kvtierd",
            "--socket",
            str(self.socket),
            "--shm-dir",
            str(self.shm_dir),
            "--metrics-port",
            "0",
            "--log-level",
            "debug",
            *self.args,
        ]
        log = open(self.log_path, "a")
        self.process = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
        log.close()
        self.wait_serving()
        return self

    def wait_serving(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"kvtierd exited with {self.process.returncode}:\n{self.log()}")
            try:
                with grpc.insecure_channel(self.address) as channel:
                    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"kvtierd did not serve within {self.start_timeout}s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text() if self.log_path.exists() else ""

    def admin(self, method: str, request=None, **fields):
        with grpc.insecure_channel(self.address) as channel:
            stub = pb_grpc.KVTierAdminStub(channel)
            rpc = getattr(stub, method)
            request_type = getattr(pb, f"{method}Request")
            return rpc(request if request is not None else request_type(**fields), timeout=10)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> int:
        if self.process is None or self.process.poll() is not None:
            return self.process.returncode if self.process else 0
        self.process.send_signal(sig)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise


def new_daemon_dir() -> Path:
    # Short paths: Unix socket paths are limited to 107 bytes.
    return Path(tempfile.mkdtemp(prefix="kvt-", dir="/tmp"))


def remove_daemon_dir(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
    shutil.rmtree(Path("/dev/shm") / path.name, ignore_errors=True)
