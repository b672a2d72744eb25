"""`python -m pagedserve.scheduler --model DIR --executor HOST:PORT --port P`: the scheduler service alone."""

from __future__ import annotations

import argparse

from pagedserve.common.auth import TokenError
from pagedserve.common.logs import configure_logging
from pagedserve.common.tls import TlsConfigError
from pagedserve.scheduler.service import serve
from pagedserve.scheduler.service_config import ServiceConfig


def build_parser() -> argparse.ArgumentParser:
    """`pagedserve scheduler`'s flags (the documentation's flag reference is generated from it)."""
    parser = argparse.ArgumentParser(prog="pagedserve scheduler", description=__doc__)
    ServiceConfig.add_cli_args(parser)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    config = ServiceConfig.from_args(parser.parse_args(argv))
    configure_logging("scheduler")
    try:
        serve(config)
    except (OSError, TokenError, TlsConfigError) as exc:  # a port in use, a bad token file: one line
        parser.exit(1, f"{parser.prog}: error: {exc}\n")


if __name__ == "__main__":
    main()
