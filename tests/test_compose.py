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
    gpu = [name for name, s in services.items() if s.get("profiles") == ["gpu"]]
    cpu = [name for name, s in services.items() if s.get("profiles") == ["cpu"]]
    assert len(gpu) == 2 and len(cpu) == 2
    daemon = services["kvtierd"]
    assert "profiles" not in daemon and daemon["ipc"] == "shareable"
    assert "kvtierd-run:/run/kvtierd" in daemon["volumes"]
    for name in gpu + cpu:
        engine = services[name]
        assert engine["ipc"] == "service:kvtierd"  # the pool file in /dev/shm is visible
        assert "kvtierd-run:/run/kvtierd" in engine["volumes"]
        config = json.loads(engine["command"][engine["command"].index("--kv-transfer-config") + 1])
        assert config["kv_connector"] == "KVTierConnector" and config["kv_connector_module_path"] == "kvtier.vllm"
        assert config["kv_load_failure_policy"] == "recompute"
        assert config["kv_connector_extra_config"]["address"] == "unix:///run/kvtierd/kvtierd.sock"
        assert engine["depends_on"]["kvtierd"]["condition"] == "service_healthy"
    for name in gpu:
        assert services[name]["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    for dockerfile in {services[n]["build"]["dockerfile"] for n in [*gpu, *cpu, "kvtierd"]}:
        assert (REPO / dockerfile).exists()
