"""What the services' entry points share for bad flags and ports (kept free of torch and grpc
imports: the scheduler and the CLI use it)."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterable
from typing import Any, NoReturn, Protocol


class _Server(Protocol):
    def add_insecure_port(self, address: str) -> int: ...

    def add_secure_port(self, address: str, server_credentials: Any) -> int: ...


def exit_bad_flags(
    message: str, flags: Iterable[str], parser: argparse.ArgumentParser | None, prog: str
) -> NoReturn:
    """Ends the program as argparse does for a bad flag value (the message, exit 2), with each of
    `flags` (dest names) spelled as the user typed it: "block_size must ..." -> "--block-size must
    ...". A config's ValueError names its fields; the user only knows the flags."""
    names = sorted(flags, key=len, reverse=True)
    if names:
        pattern = re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\b")
        message = pattern.sub(lambda m: "--" + m.group(1).replace("_", "-"), message)
    if parser is not None:
        parser.error(message)
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def listen(server: _Server, address: str, credentials: Any = None) -> int:
    """`server.add_insecure_port(address)` (grpc or grpc.aio), or `add_secure_port` with
    `credentials` (grpc.ServerCredentials: TLS only, plaintext refused), with grpc's bare "Failed
    to bind" turned into an OSError that names the flag to change; the entry points print it in
    one line."""
    try:
        if credentials is not None:
            return server.add_secure_port(address, credentials)
        return server.add_insecure_port(address)
    except RuntimeError as exc:
        raise OSError(f"cannot listen on {address} ({exc}); is --port in use?") from None
