"""docker-compose.yml is valid against the Compose specification and wires engines to the daemon."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
COMPOSE = REPO / "docker-compose.yml"


def test_compose_file_matches_the_compose_specification():
    checker = shutil.which("check-jsonschema") or str(Path(sys.executable).with_name("check-jsonschema"))
    result = subprocess.run([checker, "--builtin-schema", "vendor.compose-spec", str(COMPOSE)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_engines_share_the_daemon_socket_and_pool():
    doc = yaml.safe_load(COMPOSE.read_text())
    services = doc["services"]
    engines = {name: s for name, s in services.items() if "--kv-transfer-config" in s.get("command", [])}
    gpu = [name for name, s in engines.items() if s["profiles"] == ["gpu"]]
    cpu = [name for name, s in engines.items() if s["profiles"] == ["cpu"]]
    assert len(gpu) == 2 and len(cpu) == 2
    daemons = {"gpu": "kvtierd-gpu", "cpu": "kvtierd"}
    for profile, name in daemons.items():
        daemon = services[name]
        assert daemon["profiles"] == [profile] and daemon["ipc"] == "shareable"
        assert "kvtierd-run:/run/kvtierd" in daemon["volumes"]
    gpu_daemon = services["kvtierd-gpu"]
    assert gpu_daemon["build"]["args"]["EXTRAS"] == "cuda"  # torch and triton for the CUDA IPC copies
    assert gpu_daemon["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    for name in gpu + cpu:
        engine = services[name]
        daemon = daemons[engine["profiles"][0]]
        assert engine["ipc"] == f"service:{daemon}"  # the pool file and torch's counts in /dev/shm are visible
        assert "kvtierd-run:/run/kvtierd" in engine["volumes"]
        config = json.loads(engine["command"][engine["command"].index("--kv-transfer-config") + 1])
        assert config["kv_connector"] == "KVTierConnector" and config["kv_connector_module_path"] == "kvtier.vllm"
        assert config["kv_load_failure_policy"] == "recompute"
        assert config["kv_connector_extra_config"]["address"] == "unix:///run/kvtierd/kvtierd.sock"
        assert engine["depends_on"][daemon]["condition"] == "service_healthy"
    assert all(services[name]["pid"] == "service:kvtierd-gpu" for name in gpu)  # CUDA IPC: not sibling PID namespaces
    devices = [services[name]["deploy"]["resources"]["reservations"]["devices"][0] for name in gpu]
    assert all(d["capabilities"] == ["gpu"] and "count" not in d for d in devices)
    assert len({d["device_ids"][0] for d in devices}) == 2  # a GPU each by default (count: 1 gives both GPU 0)
    for dockerfile in {services[n]["build"]["dockerfile"] for n in [*gpu, *cpu, *daemons.values()]}:
        assert (REPO / dockerfile).exists()
