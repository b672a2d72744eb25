"""`python -m pagedserve.executor --model DIR --port P`: the executor service alone (`pagedserve executor`).

Logging follows the shared pagedserve setup: PAGEDSERVE_LOG_LEVEL, PAGEDSERVE_LOG_FORMAT=json.

Errors a restart cannot fix (the model, the flags, a KV pool too small for --max-model-len, the
token or TLS files) exit with status 78 (`os.EX_CONFIG`, sysexits.h's configuration error) and one
line naming the problem: `pagedserve serve` then stops instead of restarting the executor.
"""

from __future__ import annotations

import argparse
import os

from pagedserve.common.auth import TokenError
from pagedserve.common.logs import configure_logging
from pagedserve.common.tls import TlsConfigError
from pagedserve.executor.config import ExecutorConfig, add_cli_args
from pagedserve.executor.disk_tier import DiskTierError
from pagedserve.executor.kv_cache import HostPoolError, KVCacheTooSmallError
from pagedserve.executor.loader import UnsupportedModelError

# What no restart fixes (UnsupportedModelError covers the FP8 and tensor-parallel refusals too).
CONFIG_ERRORS = (
    UnsupportedModelError,
    KVCacheTooSmallError,
    HostPoolError,
    DiskTierError,
    FileNotFoundError,
    TokenError,
    TlsConfigError,
)


def build_parser() -> argparse.ArgumentParser:
    """`pagedserve executor`'s flags (the documentation's flag reference is generated from it)."""
    return add_cli_args(argparse.ArgumentParser(prog="pagedserve executor", description=__doc__))


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    config = ExecutorConfig.from_args(parser.parse_args(argv))
    configure_logging("executor")
    if config.tensor_parallel_size > 1:  # a size the model or the machine cannot take is a bad flag
        from pagedserve.executor.parallel import TensorParallelError
        from pagedserve.executor.tp_workers import check_config

        try:
            check_config(config)
        except TensorParallelError as exc:
            parser.error(str(exc))

    from pagedserve.executor.service import serve  # after parsing: --help stays fast

    try:
        serve(config)
    except CONFIG_ERRORS as exc:  # one line, no traceback
        parser.exit(os.EX_CONFIG, f"{parser.prog}: error: {exc}\n")
    except OSError as exc:  # a port in use, a device gone: may pass, so serve restarts us
        parser.exit(1, f"{parser.prog}: error: {exc}\n")


if __name__ == "__main__":
    main()
