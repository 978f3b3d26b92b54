import subprocess
import sys

import pytest

from kvtier.sizes import format_size, parse_size
from kvtierd.config import Config, load_config


@pytest.mark.parametrize(
    "text,expected",
    [("4096", 4096), ("512MiB", 512 << 20), ("64GiB", 64 << 30), ("1.5GiB", 3 << 29), ("2G", 2_000_000_000), ("8 KiB", 8192)],
)
def test_sizes(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "12 parsecs", "-1GiB", "GiB"])
def test_bad_sizes(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_format_size():
    assert format_size(64 << 30) == "64.0 GiB"
    assert format_size(100) == "100 B"


def test_precedence_flags_over_env_over_toml(tmp_path):
    toml = tmp_path / "kvtierd.toml"
    toml.write_text('pool-size = "2GiB"\neviction = "arc"\nstore_threshold = 3\nsocket-mode = "0600"\n')
    config = load_config(["--config", str(toml)], environ={})
    assert (config.pool_size, config.eviction, config.store_threshold, config.socket_mode) == (2 << 30, "arc", 3, 0o600)
    config = load_config(["--config", str(toml)], environ={"KVTIERD_POOL_SIZE": "3GiB"})
    assert config.pool_size == 3 << 30 and config.eviction == "arc"
    config = load_config(["--config", str(toml), "--pool-size", "512MiB"], environ={"KVTIERD_POOL_SIZE": "3GiB"})
    assert config.pool_size == 512 << 20


def test_toml_integer_modes_and_sizes(tmp_path):
    toml = tmp_path / "kvtierd.toml"
    toml.write_text("socket-mode = 0o660\nshm-mode = 0o600\npool-size = 1073741824\nprefault = false\n")
    config = load_config(["--config", str(toml)], environ={})
    assert (config.socket_mode, config.shm_mode, config.pool_size, config.prefault) == (0o660, 0o600, 1 << 30, False)


def test_defaults_are_safe():
    config = load_config([], environ={})
    assert config.listen == ""
    assert config.socket_mode == 0o660
    assert config.shm_mode == 0o600
    assert config.pool_size == 1 << 30
    assert config.metrics_host == "127.0.0.1"
    assert config.socket.name == "kvtierd.sock"


def test_default_socket_follows_xdg_runtime_dir(monkeypatch, tmp_path):
    from kvtier.paths import default_socket_path

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert default_socket_path() == tmp_path / "kvtierd" / "kvtierd.sock"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert str(default_socket_path()).startswith("/tmp/kvtierd-")


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--eviction", "fifo"], "must be one of"),
        (["--pool-size", "lots"], "not a size"),
        (["--page-size", "1000"], "multiple of 4096"),
        (["--store-threshold", "0"], "store_threshold"),
        (["--max-message-size", "64KiB"], "max_message_size must be at least 1 MiB"),
        (["--max-message-size", "2GiB"], "below 2 GiB"),  # (gRPC's limit is an int32: the daemon died at start)
        (["--socket", "/tmp/a%41.sock"], "gRPC reads it as a URI"),  # (gRPC bound /tmp/aA.sock: another daemon's)
        (["--lease-ttl", "5000000"], "about 49.7 days"),  # (announced in milliseconds, a uint32)
        (["--max-batch-blocks", "5000000000"], "below 2\\*\\*32"),  # (announced as a uint32: a traceback at start)
        (["--max-namespaces", "0"], "max_namespaces must be >= 1"),
        (["--max-namespaces", "200", "--max-message-size", "1MiB"], "needs a max_message_size of at least 2 MiB"),
    ],
)
def test_bad_options_exit_with_a_message(argv, message):
    with pytest.raises(SystemExit, match=message):
        load_config(argv, environ={})


def test_unknown_toml_key(tmp_path):
    toml = tmp_path / "bad.toml"
    toml.write_text("pool_sise = 1\n")
    with pytest.raises(SystemExit, match="unknown option"):
        load_config(["--config", str(toml)], environ={})


def test_help_documents_every_option():
    out = subprocess.run([sys.executable, "-m", "kvtierd", "--help"], capture_output=True, text=True, check=True).stdout
    for name in Config.__dataclass_fields__:
        assert "--" + name.replace("_", "-") in out
        assert "KVTIERD_" + name.upper() in out
