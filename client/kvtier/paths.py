"""Default locations shared by the daemon and its clients."""

from __future__ import annotations

import os
from pathlib import Path


def default_runtime_dir() -> Path:
    """`$XDG_RUNTIME_DIR/kvtierd`, or `/tmp/kvtierd-<uid>` when XDG_RUNTIME_DIR is unset."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        return Path(runtime) / "kvtierd"
    return Path("/tmp") / f"kvtierd-{os.getuid()}"


def default_socket_path() -> Path:
    return default_runtime_dir() / "kvtierd.sock"


def default_address() -> str:
    return f"unix://{default_socket_path()}"


def normalize_address(address: str | None) -> str:
    """Accept `unix:///path`, `unix:/path`, a bare filesystem path or `host:port`."""
    if not address:
        return default_address()
    if address.startswith(("unix:", "dns:", "ipv4:", "ipv6:")):
        return address
    if address.startswith("/") or address.startswith("."):
        return f"unix://{Path(address).resolve()}"
    return address
