"""`kvtierd` console script."""

from __future__ import annotations

import uvloop

from kvtierd.config import load_config
from kvtierd.logs import setup_logging
from kvtierd.server import serve


def main(argv: list[str] | None = None) -> None:
    config = load_config(argv)
    setup_logging(config.log_level, config.log_format)
    uvloop.run(serve(config))


if __name__ == "__main__":
    main()
