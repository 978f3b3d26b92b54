"""Starts real vLLM engines (kvtier.demo.engine_process) as processes and collects their results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ENGINE_TIMEOUT = 600


def engine_env() -> dict[str, str]:
    return {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "PYTHONUNBUFFERED": "1",
    }


@dataclass
class Engine:
    process: subprocess.Popen
    result_path: Path
    log_path: Path

    def wait_for_line(self, text: str, timeout: float = ENGINE_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.log():
                return
            if self.process.poll() is not None:
                raise AssertionError(f"engine exited ({self.process.returncode}) before {text!r}:\n{self.log()[-6000:]}")
            time.sleep(0.1)
        raise AssertionError(f"engine did not print {text!r} in {timeout}s:\n{self.log()[-6000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def result(self, timeout: float = ENGINE_TIMEOUT) -> dict:
        try:
            code = self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            raise AssertionError(f"engine did not finish in {timeout}s:\n{self.log()[-6000:]}") from None
        assert code == 0, f"engine failed with {code}:\n{self.log()[-6000:]}"
        return json.loads(self.result_path.read_text())


def start_engine(
    workdir: Path,
    name: str,
    model: Path,
    phases: list[dict],
    connector: dict | None = None,
    kv_transfer: dict | None = None,
    multiprocess: bool = False,
    dtype: str = "float32",
    kv_bytes: int = 32 << 20,
    max_tokens: int = 8,
    max_model_len: int = 4096,
    max_lora_rank: int = 0,
) -> Engine:
    spec = {
        "max_lora_rank": max_lora_rank,
        "model": str(model),
        "dtype": dtype,
        "kv_bytes": kv_bytes,
        "max_tokens": max_tokens,
        "max_model_len": max_model_len,
        "connector": connector,
        "kv_transfer": kv_transfer,
        "multiprocess": multiprocess,
        "phases": phases,
    }
    spec_path = workdir / f"{name}.spec.json"
    spec_path.write_text(json.dumps(spec))
    log_path = workdir / f"{name}.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "kvtier.demo.engine_process", str(spec_path), str(workdir / f"{name}.result.json")],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=engine_env(),
        )
    return Engine(process, workdir / f"{name}.result.json", log_path)


def run_engine(workdir: Path, name: str, model: Path, phases: list[dict], **kwargs) -> dict:
    return start_engine(workdir, name, model, phases, **kwargs).result()
