"""What the services' entry points share for bad flags (kept free of torch: the scheduler uses it)."""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterable
from typing import NoReturn


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
