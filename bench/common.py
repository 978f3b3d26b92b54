"""Shared benchmark plumbing: a real daemon in a subprocess, timing summaries, result files."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"
sys.path.insert(0, str(REPO / "tests"))

from daemon import DaemonProcess, new_daemon_dir, remove_daemon_dir  # noqa: E402


def start_daemon(*args: str) -> DaemonProcess:
    """A daemon given two minutes to serve: a fresh GPU machine takes longer than 20 s to touch and pin
    a pool of 12 GiB and compile the copy kernel."""
    return DaemonProcess(new_daemon_dir(), list(args), start_timeout=120).start()


def stop_daemon(daemon: DaemonProcess) -> None:
    daemon.stop()
    remove_daemon_dir(daemon.directory)


def summarize(seconds: list[float]) -> dict[str, float]:
    ms = np.asarray(seconds) * 1000
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)), "n": len(ms)}


def timed(fn, iterations: int, warmup: int = 20) -> dict[str, float]:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iterations):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return summarize(samples)


def write_result(name: str, result: dict, command: str) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    result = {
        "command": command,
        "machine": {"cpus": _cpus(), "python": platform.python_version(), "platform": platform.platform()},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        **result,
    }
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def _cpus() -> str:
    try:
        return subprocess.run(["nproc"], capture_output=True, text=True).stdout.strip()
    except OSError:
        return "?"


def pyplot():
    """matplotlib.pyplot drawing to files (no display), or None when matplotlib is not installed
    (the GPU machine has none: results are still written, without the plot)."""
    try:
        import matplotlib  # noqa: PLC0415
    except ImportError:
        print("matplotlib missing: no plot")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    return plt
