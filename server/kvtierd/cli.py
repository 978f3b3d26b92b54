"""`kvtierd` console script."""

from __future__ import annotations

import logging
import os
import resource

import uvloop

from kvtierd.config import load_config
from kvtierd.logs import setup_logging
from kvtierd.server import serve

UMASK = 0o027  # what the daemon makes is never writable by its group, nor reachable by other users


def main(argv: list[str] | None = None) -> None:
    os.umask(UMASK)  # (whatever it inherits: a umask of 000 made the fs tier's directories writable by all)
    config = load_config(argv)
    setup_logging(config.log_level, config.log_format)
    raise_open_files_limit()
    uvloop.run(serve(config))


def raise_open_files_limit() -> None:
    """Every engine worker holds a gRPC connection and a data socket connection per calling thread,
    and the fs tier's I/O threads open block files: the soft limit on open files goes up to the hard
    one (often 1024 against 524288), as servers commonly do, so a host of many engines does not
    run out of descriptors (new engines would then not connect)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        logging.getLogger("kvtierd").info("open files limit raised", extra={"from": soft, "to": hard})


if __name__ == "__main__":
    main()
