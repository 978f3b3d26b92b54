"""Daemon configuration: defaults < TOML file < KVTIERD_* environment < command-line flags."""

from __future__ import annotations

import argparse
import dataclasses
import os
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.paths import default_socket_path
from kvtier.sizes import parse_size
from kvtierd.namespace import MAX_SPEC_BYTES

NAMESPACE_ANSWER_BYTES = MAX_SPEC_BYTES + 1024  # the most one namespace adds to a GetStats or ListNamespaces answer

ENV_PREFIX = "KVTIERD_"


def _option(default: Any, help: str, parse: Callable[[str], Any] = str, choices: tuple[str, ...] = ()) -> Any:
    return field(default=default, metadata={"help": help, "parse": parse, "choices": choices})


def _parse_bool(text: str) -> bool:
    lowered = str(text).strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _parse_socket(text: str) -> Path:
    """An absolute path; gRPC reads it as a URI, where '%', '?' and '#' would name another file."""
    if any(c in text for c in "%?#"):
        raise ValueError(f"{text!r}: a socket path may not hold '%', '?' or '#' (gRPC reads it as a URI)")
    return Path(text).absolute()


def _parse_mode(text: str) -> int:
    return int(str(text), 8)


def _parse_seconds(text: str) -> float:
    value = str(text).strip().lower()
    return float(value[:-1]) if value.endswith("s") else float(value)


@dataclass(frozen=True)
class Config:
    socket: Path = _option(default_socket_path(), "Unix socket to serve on (created with --socket-mode).", _parse_socket)
    socket_mode: int = _option(0o660, "Permissions of the Unix socket (octal).", _parse_mode)
    trust_directories: bool = _option(
        False,
        "Use the socket directory, --shm-dir and --fs-path even when another user owns them or every user "
        "may write in them (e.g. a Kubernetes emptyDir only this pod's containers reach).",
        _parse_bool,
    )
    listen: str = _option("", "Also listen on TCP HOST:PORT (off unless given; no authentication).")
    data_socket: bool = _option(
        True,
        "Also serve the unary data-plane calls on <socket>.data, a plain Unix socket (same messages, "
        "without gRPC's per-call cost); engines on this host use it when offered.",
        _parse_bool,
    )
    pool_size: int = _option(1 << 30, "Size of the shared-memory pool (RAM tier), e.g. 512MiB, 64GiB.", parse_size)
    page_size: int = _option(32 << 10, "Pool page size; a block occupies ceil(block_bytes/page_size) pages.", parse_size)
    shm_dir: Path = _option(Path("/dev/shm"), "Directory of the pool's shared-memory file.", Path)
    shm_mode: int = _option(0o600, "Permissions of the pool file (0600 owner only, 0660 group).", _parse_mode)
    prefault: bool = _option(True, "Touch every pool page at start so no page faults happen later.", _parse_bool)
    cuda_register: bool = _option(True, "Pin the pool with cudaHostRegister when CUDA is available.", _parse_bool)
    eviction: str = _option("lru", "Eviction policy of the RAM tier.", str, ("lru", "arc"))
    store_threshold: int = _option(1, "Store a block only after it was offered this many times.", int)
    lease_ttl: float = _option(
        30.0, "Seconds a pin lease or reservation may live, from its creation; then it is freed.", _parse_seconds
    )
    max_batch_blocks: int = _option(4096, "Most block hashes one call may carry.", int)
    max_message_size: int = _option(
        64 << 20, "Largest gRPC message (bounds inline transfers; at least 1 MiB, below 2 GiB).", parse_size
    )
    max_namespaces: int = _option(64, "Most namespaces the daemon keeps.", int)
    fs_path: str = _option("", "Directory of the filesystem tier behind the pool (off unless given).")
    fs_size: int = _option(0, "Most bytes the filesystem tier may hold, e.g. 500GiB (needed with --fs-path).", parse_size)
    fs_eviction: str = _option("lru", "Eviction policy of the filesystem tier.", str, ("lru", "arc"))
    fs_write_through: bool = _option(False, "Also write every committed block to disk (not only evicted ones).", _parse_bool)
    fs_io_threads: int = _option(
        8, "Threads writing the filesystem tier's files (each writes, fsyncs and renames a block file); as many more read.", int
    )
    fs_direct_io: bool = _option(False, "Use O_DIRECT for block files where the filesystem allows it.", _parse_bool)
    fs_queue_size: int = _option(
        1 << 30,
        "Most bytes of blocks copied out of the pool and waiting to be written to disk; later ones are not written.",
        parse_size,
    )
    fs_index_interval: float = _option(
        30.0, "Seconds between rewrites of the fs tier's index file (while it changes; also on shutdown).", _parse_seconds
    )
    metrics_host: str = _option("127.0.0.1", "Address of the Prometheus metrics HTTP listener.")
    metrics_port: int = _option(9464, "Prometheus metrics port (0: any free port, -1: off).", int)
    log_level: str = _option("info", "Log level.", str, ("debug", "info", "warning", "error"))
    log_format: str = _option("text", "Log line format.", str, ("text", "json"))

    def as_strings(self) -> dict[str, str]:
        return {f.name: _render(getattr(self, f.name), f.name) for f in dataclasses.fields(self)}


def _render(value: Any, name: str) -> str:
    if name.endswith("_mode"):
        return oct(value)
    return str(value)


def _convert(f: dataclasses.Field, raw: Any, source: str) -> Any:
    parse = f.metadata["parse"]
    try:
        # TOML integers (e.g. socket-mode = 0o660) are taken as they are; strings go through the parser.
        takes_int = parse in (int, parse_size, _parse_mode) and isinstance(raw, int) and not isinstance(raw, bool)
        value = raw if takes_int else parse(str(raw))
    except ValueError as exc:
        raise SystemExit(f"kvtierd: bad value for {f.name} from {source}: {exc}") from exc
    choices = f.metadata["choices"]
    if choices and value not in choices:
        raise SystemExit(f"kvtierd: {f.name} from {source} must be one of {', '.join(choices)}, not {value!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtierd",
        description="Host-local KV-cache tier server for vLLM. Every option can also be set through "
        f"{ENV_PREFIX}<OPTION> environment variables (e.g. {ENV_PREFIX}POOL_SIZE=64GiB) or a TOML file "
        "(--config); flags win over the environment, which wins over the file.",
    )
    parser.add_argument("--config", type=Path, default=None, help="TOML file with options (keys as below, '-' or '_').")
    for f in dataclasses.fields(Config):
        default = f.default
        shown = oct(default) if f.name.endswith("_mode") else default
        parser.add_argument(
            "--" + f.name.replace("_", "-"),
            dest=f.name,
            default=None,
            metavar=f.name.upper(),
            help=f"{f.metadata['help']} [env {ENV_PREFIX}{f.name.upper()}; default: {shown}]",
        )
    return parser


def load_config(argv: list[str] | None = None, environ: dict[str, str] | None = None) -> Config:
    args = build_parser().parse_args(argv)
    environ = dict(os.environ if environ is None else environ)
    values: dict[str, Any] = {}
    fields = {f.name: f for f in dataclasses.fields(Config)}
    if args.config is not None:
        try:
            table = tomllib.loads(args.config.read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise SystemExit(f"kvtierd: cannot read config file {args.config}: {exc}") from exc
        for key, raw in table.items():
            name = key.replace("-", "_")
            if name not in fields:
                raise SystemExit(f"kvtierd: unknown option {key!r} in {args.config}")
            values[name] = _convert(fields[name], raw, str(args.config))
    for name, f in fields.items():
        env_name = ENV_PREFIX + name.upper()
        if env_name in environ:
            values[name] = _convert(f, environ[env_name], env_name)
        flag_value = getattr(args, name)
        if flag_value is not None:
            values[name] = _convert(f, flag_value, "--" + name.replace("_", "-"))
    config = Config(**values)
    _validate(config)
    return config


def _validate(config: Config) -> None:
    problems = []
    if config.page_size < 4096 or config.page_size % 4096:
        problems.append("page_size must be a multiple of 4096")
    if config.pool_size < config.page_size * 16:
        problems.append("pool_size must hold at least 16 pages")
    if config.store_threshold < 1:
        problems.append("store_threshold must be >= 1")
    if not 0 < config.lease_ttl * 1000 < 1 << 32:  # (announced in milliseconds, a uint32)
        problems.append("lease_ttl must be > 0 and below 2**32 milliseconds (about 49.7 days)")
    if not 1 << 20 <= config.max_message_size < 1 << 31:  # (a load's answer keeps 64 KiB; gRPC's limit is an int32)
        problems.append("max_message_size must be at least 1 MiB and below 2 GiB")
    if not (0 < config.max_batch_blocks < 1 << 32 and 0 < config.max_namespaces < 1 << 32):  # (announced as uint32s)
        problems.append("max_batch_blocks and max_namespaces must be >= 1 and below 2**32")
    elif config.max_namespaces * NAMESPACE_ANSWER_BYTES > config.max_message_size:
        least = -(-config.max_namespaces * NAMESPACE_ANSWER_BYTES // (1 << 20))
        problems.append(
            f"max_namespaces {config.max_namespaces} needs a max_message_size of at least {least} MiB "
            f"(GetStats and ListNamespaces answer with every namespace, up to {NAMESPACE_ANSWER_BYTES} bytes each)"
        )
    if config.fs_path and config.fs_size <= 0:
        problems.append("fs_size must be given (> 0) with fs_path")
    if config.fs_io_threads < 1:
        problems.append("fs_io_threads must be >= 1")
    if problems:
        raise SystemExit("kvtierd: " + "; ".join(problems))
