"""deploy/: the Kubernetes manifests are valid and wire the engines to the daemon the way it needs,
the real daemon runs on their configuration, and the Grafana dashboard charts every metric it exports."""

import json
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import urllib.request
from pathlib import Path

import pytest
import yaml

from kvtier.sizes import parse_size
from kvtierd.config import load_config

REPO = Path(__file__).resolve().parent.parent
K8S = REPO / "deploy" / "k8s"
DASHBOARD = REPO / "deploy" / "dashboards" / "kvtierd.json"
_QUANTITY_UNITS = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}


def _resources() -> dict[tuple[str, str], dict]:
    docs = [doc for path in sorted(K8S.glob("*.yaml")) for doc in yaml.safe_load_all(path.read_text()) if doc]
    return {(doc["kind"], doc["metadata"]["name"]): doc for doc in docs}


def _config() -> dict:
    return tomllib.loads(_resources()["ConfigMap", "kvtierd-config"]["data"]["kvtierd.toml"])


def _bytes(quantity: str) -> int:
    number, unit = re.fullmatch(r"(\d+)([KMGT]i)", quantity).groups()
    return int(number) * _QUANTITY_UNITS[unit]


def _host_mounts(pod: dict, container: dict) -> dict[str, str]:
    """mountPath -> host path of the container's hostPath volumes."""
    host = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    return {m["mountPath"]: host[m["name"]] for m in container["volumeMounts"] if m["name"] in host}


def test_manifests_match_the_kubernetes_schemas():
    checker = shutil.which("kubernetes-validate") or str(Path(sys.executable).with_name("kubernetes-validate"))
    manifests = sorted(str(p) for p in K8S.glob("*.yaml"))
    assert len(manifests) == 4
    result = subprocess.run([checker, "--strict", "-k", "1.37.0", *manifests], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("passed for resource") == 5  # (two namespaces, the config, the daemon, the engines)


def test_engines_reach_the_daemon_where_it_serves():
    resources = _resources()
    config = _config()
    daemon_pod = resources["DaemonSet", "kvtierd"]["spec"]["template"]
    engine_pod = resources["Deployment", "vllm"]["spec"]["template"]
    daemon, engine = daemon_pod["spec"]["containers"][0], engine_pod["spec"]["containers"][0]

    # the daemon reads the ConfigMap's file
    assert daemon["args"] == ["--config", "/etc/kvtierd/kvtierd.toml"]
    config_volume = next(v for v in daemon_pod["spec"]["volumes"] if v["name"] == "config")
    assert config_volume["configMap"]["name"] == "kvtierd-config"
    assert {"name": "config", "mountPath": "/etc/kvtierd", "readOnly": True} in daemon["volumeMounts"]

    # the socket and pool directories are the node's, at the same paths in both pods; the fs tier is on the node
    socket_dir, shm_dir = str(Path(config["socket"]).parent), config["shm-dir"]
    daemon_mounts, engine_mounts = _host_mounts(daemon_pod["spec"], daemon), _host_mounts(engine_pod["spec"], engine)
    for path in (socket_dir, shm_dir):
        assert daemon_mounts[path] == engine_mounts[path] == path
    assert daemon_mounts[str(Path(config["fs-path"]).parent)] == str(Path(config["fs-path"]).parent)

    # CUDA IPC opens handles only between processes of one user, in PID namespaces one inside the other
    # (two pods' own are siblings: the daemon takes the host's); torch's counts are in the host's /dev/shm
    assert daemon_pod["spec"]["hostPID"] is True
    for pod, container in ((daemon_pod, daemon), (engine_pod, engine)):
        assert pod["spec"]["hostIPC"] is True
        assert (pod["spec"]["securityContext"]["runAsUser"], pod["spec"]["securityContext"]["runAsGroup"]) == (1000, 1000)
        assert "USER" in {variable["name"] for variable in container["env"]}  # (uid 1000 has no account)
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in daemon_pod["spec"]["tolerations"]
    assert config["socket-mode"] == config["shm-mode"] == "0660"  # (the group's engines may connect and map the pool)
    directories = daemon_pod["spec"]["initContainers"][0]
    assert directories["command"][:8] == ["install", "-d", "-o", "1000", "-g", "1000", "-m", "0750"]
    assert set(directories["command"][8:]) == {socket_dir, shm_dir, str(Path(config["fs-path"]).parent)}
    assert _host_mounts(daemon_pod["spec"], directories) == {p: p for p in directories["command"][8:]}

    # the engine's connector dials the daemon's socket; the probes ask the daemon's health there
    command = engine["args"]
    transfer = json.loads(command[command.index("--kv-transfer-config") + 1])
    assert transfer["kv_connector"] == "KVTierConnector" and transfer["kv_connector_module_path"] == "kvtier.vllm"
    assert transfer["kv_load_failure_policy"] == "recompute"
    assert transfer["kv_connector_extra_config"]["address"] == f"unix://{config['socket']}"
    for probe in ("startupProbe", "livenessProbe"):
        assert daemon[probe]["exec"]["command"] == ["kvtierctl", "--address", f"unix://{config['socket']}", "health"]

    # metrics where Prometheus is told to scrape them
    annotations = daemon_pod["metadata"]["annotations"]
    assert daemon["ports"] == [{"name": "metrics", "containerPort": config["metrics-port"]}]
    assert annotations["prometheus.io/port"] == str(config["metrics-port"]) and config["metrics-host"] == "0.0.0.0"

    # the pool's pages count against the daemon's pod
    memory = _bytes(daemon["resources"]["limits"]["memory"])
    assert memory == _bytes(daemon["resources"]["requests"]["memory"])
    assert memory >= parse_size(config["pool-size"]) + parse_size(config["fs-queue-size"]) + (4 << 30)


def test_the_images_are_the_ones_the_dockerfiles_build():
    resources = _resources()
    daemon_pod = resources["DaemonSet", "kvtierd"]["spec"]["template"]["spec"]
    engine_pod = resources["Deployment", "vllm"]["spec"]["template"]["spec"]
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]
    assert {c["image"] for c in daemon_pod["initContainers"] + daemon_pod["containers"]} == {compose["kvtierd-gpu"]["image"]}
    assert engine_pod["containers"][0]["image"] == compose["vllm-a"]["image"]
    # The image's KVTIERD_* variables win over the ConfigMap's file: they must say the same.
    dockerfile = (REPO / "deploy" / "container" / "Dockerfile").read_text()
    env_line = re.search(r"^ENV (.*?[^\\])$", dockerfile, re.S | re.M).group(1)
    image_env = dict(item.split("=", 1) for item in shlex.split(env_line.replace("\\\n", " ")))
    config = _config()
    for name, value in image_env.items():
        key = name.removeprefix("KVTIERD_").lower().replace("_", "-")
        assert str(config[key]) == value, key


# What a test daemon takes from its flags instead of the ConfigMap's file (flags win): the node's paths
# and sizes, and loopback metrics on a free port.
_LOCAL = ("socket", "shm-dir", "pool-size", "fs-path", "fs-size", "fs-queue-size", "metrics-host", "metrics-port")


@pytest.fixture
def k8s_daemon(fs_daemons, tmp_path):
    """The real daemon on the ConfigMap's file, with the _LOCAL options given as flags."""
    toml = tmp_path / "kvtierd.toml"
    toml.write_text(_resources()["ConfigMap", "kvtierd-config"]["data"]["kvtierd.toml"])
    return fs_daemons("--config", str(toml), "--metrics-host", "127.0.0.1")


def test_the_daemon_runs_on_the_kubernetes_configuration(k8s_daemon, tmp_path):
    config = _config()
    assert set(_LOCAL) <= set(config)  # (the DaemonSet's mounts and memory follow these)
    wanted = load_config(["--config", str(tmp_path / "kvtierd.toml")], environ={}).as_strings()  # (k8s_daemon's file)
    served = k8s_daemon.admin("GetInfo").config
    taken = {key.replace("-", "_") for key in config} - {key.replace("-", "_") for key in _LOCAL}
    assert taken and {key: served[key] for key in taken} == {key: wanted[key] for key in taken}
    assert json.loads(k8s_daemon.log().splitlines()[-1])  # (json lines, as the ConfigMap asks)


def _exported_series(metrics_text: str) -> set[str]:
    """The sample names of every family the daemon exports (labelled families without samples yet too)."""
    names = set()
    for family, kind in re.findall(r"^# TYPE (\S+) (\S+)$", metrics_text, re.M):
        names |= {f"{family}_bucket", f"{family}_sum", f"{family}_count"} if kind == "histogram" else {family}
    return names


def _family(series: str) -> str:
    return re.sub(r"_(bucket|sum|count)$", "", series)


def _dashboard_exprs() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [target["expr"] for panel in panels for target in panel.get("targets", [])]


def test_the_dashboard_charts_every_metric_the_daemon_exports(k8s_daemon):
    port = k8s_daemon.admin("GetInfo").metrics_port
    metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    exported = {name for name in _exported_series(metrics) if name.startswith("kvtierd_") and not name.endswith("_created")}
    charted = {name for expr in _dashboard_exprs() for name in re.findall(r"\bkvtierd_[a-z_]+", expr)}
    assert charted <= exported, charted - exported  # (a renamed metric leaves an empty panel)
    families, shown = {_family(name) for name in exported}, {_family(name) for name in charted}
    assert families == shown, families - shown  # (a new metric gets a panel)
    assert "kvtierd_fs_queue_bytes" in exported and "kvtierd_cuda_copy_seconds_bucket" in exported


def _documented_labels() -> dict[str, set[str]]:
    """metric -> its label names, from the tables of docs/metrics.md."""
    rows = re.findall(r"^\| `(kvtierd_\w+)` \| \w+ \| ([^|]*) \|", (REPO / "docs" / "metrics.md").read_text(), re.M)
    return {name: set(re.findall(r"`(\w+)`", re.sub(r"\(.*?\)", "", labels))) for name, labels in rows}


def test_the_dashboard_asks_for_labels_the_metrics_have():
    documented = _documented_labels()
    for expr in _dashboard_exprs():
        families = {_family(name) for name in re.findall(r"\bkvtierd_[a-z_]+", expr)}
        assert families <= set(documented), families - set(documented)
        for name, selector in re.findall(r"\b(kvtierd_[a-z_]+)(\{[^}]*\})", expr):
            matchers = dict(re.findall(r'(\w+)=~?"([^"]*)"', selector))
            assert set(matchers) - {"instance"} <= documented[_family(name)], (name, matchers)
            assert matchers.get("tier", "ram") in {"ram", "fs"}, expr
        labels = set().union(*(documented[family] for family in families))
        for grouping in re.findall(r"by \(([^)]*)\)", expr):
            assert {label.strip() for label in grouping.split(",")} - {"le"} <= labels, (grouping, expr)


def test_every_dashboard_query_follows_the_daemon_picker():
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus" and variables["instance"]["includeAll"]
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    for panel in panels:
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
        for target in panel.get("targets", []):
            selectors = re.findall(r"kvtierd_[a-z_]+(\{[^}]*\})?", target["expr"])
            assert selectors and all('instance=~"$instance"' in s for s in selectors), target["expr"]
            assert target["datasource"]["uid"] == "${datasource}"
