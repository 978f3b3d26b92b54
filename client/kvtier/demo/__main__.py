"""`python -m kvtier.demo`: start kvtierd, then engine A and engine B (separate vLLM processes, CPU),
send both requests that share a long system prompt, and show where B's prefix came from.

Prints per-request time to first token and cached-token counts for both engines, then
`kvtierctl stats`, and stops everything.
"""

from __future__ import annotations

import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvtier import ctl
from kvtier.demo.engines import run_engine
from kvtier.demo.tiny_model import make_tiny_llama

MODEL_DIR = Path.home() / ".cache" / "kvtierd" / "demo-llama-8l-512"
SYSTEM_PROMPT_TOKENS = 1536
QUESTION_TOKENS = 64


def start_daemon(directory: Path) -> subprocess.Popen:
    socket = directory / "kvtierd.sock"
    command = [sys.executable, "-m", "kvtierd", "--socket", str(socket), "--pool-size", "512MiB", "--metrics-port", "0"]
    process = subprocess.Popen(command, stderr=open(directory / "kvtierd.log", "w"))
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with grpc.insecure_channel(f"unix://{socket}") as channel:
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
            return process
        except grpc.RpcError:
            time.sleep(0.1)
    process.kill()
    raise SystemExit(f"kvtierd did not start; see {directory / 'kvtierd.log'}")


def requests(seed: int, count: int, system: list[int]) -> list[dict]:
    rng = random.Random(seed)
    return [{"tokens": system + [rng.randrange(3, 2048) for _ in range(QUESTION_TOKENS)]} for _ in range(count)]


def show(engine: str, prompts: list[dict], outputs: list[dict]) -> None:
    for i, (p, out) in enumerate(zip(prompts, outputs, strict=True)):
        print(
            f"  engine {engine}  request {i}  prompt {len(p['tokens']):5d} tokens  "
            f"cached {out['num_cached_tokens']:5d}  TTFT {out['seconds'] * 1000:7.1f} ms"
        )


def main() -> None:
    print(f"making a local Llama-architecture model with random weights in {MODEL_DIR} ...")
    model = make_tiny_llama(MODEL_DIR, seed=0, layers=8, hidden=512, heads=8, kv_heads=4, vocab=2048)
    workdir = Path(tempfile.mkdtemp(prefix="kvtierd-demo-"))
    address = f"unix://{workdir}/kvtierd.sock"
    print(f"starting kvtierd on {address}")
    daemon = start_daemon(workdir)
    system = [random.Random(7).randrange(3, 2048) for _ in range(SYSTEM_PROMPT_TOKENS)]
    connector = {"address": address}
    engine_options = {"connector": connector, "max_tokens": 1, "kv_bytes": 256 << 20}
    try:
        print("engine A (its own process): computes the shared system prompt and stores it in kvtierd ...")
        a_prompts = requests(1, 3, system)
        a = run_engine(workdir, "engine-a", model, [{"prompts": a_prompts}], **engine_options)
        show("A", a_prompts, a["phases"][0])
        print("engine B (a new process, empty cache): the same system prompt, other questions ...")
        b_prompts = requests(2, 3, system)
        b = run_engine(workdir, "engine-b", model, [{"prompts": b_prompts}], **engine_options)
        show("B", b_prompts, b["phases"][0])
        hit = b["phases"][0][0]["num_cached_tokens"]
        cold, warm = a["phases"][0][0]["seconds"], b["phases"][0][0]["seconds"]
        print(
            f"\nHIT: engine B's first request found {hit} tokens computed by engine A in kvtierd; "
            f"its time to first token was {warm * 1000:.0f} ms against {cold * 1000:.0f} ms cold ({cold / warm:.1f}x)."
        )
        print("\n$ kvtierctl stats")
        ctl.main(["--address", address, "stats"])
        if hit == 0:
            raise SystemExit(f"demo failed: engine B got no hit; logs in {workdir}")
    finally:
        daemon.terminate()
        daemon.wait(timeout=30)
        print(f"\nkvtierd stopped (exit code {daemon.returncode}).")
    shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
