"""Regenerates the committed gRPC stubs from the .proto files.

The stubs are committed (made with grpcio-tools 1.84.x, so they import under grpcio >= 1.84) and
flattened into this package: protoc's `from pagedserve.v1 import x_pb2` becomes
`from pagedserve.protos import x_pb2`. `tests/test_protos.py` fails when they are out of date.

Usage: python -m pagedserve.protos.generate [--check]
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PROTO_FILES = (
    "pagedserve/v1/generation.proto",
    "pagedserve/v1/executor.proto",
    "pagedserve/v1/admin.proto",
)


def generate() -> dict[str, str]:
    """Runs protoc and returns {stub file name: contents}, imports rewritten."""
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as out:
        args = ["protoc", f"-I{PROTO_ROOT}", f"--python_out={out}", f"--grpc_python_out={out}"]
        if protoc.main([*args, *PROTO_FILES]) != 0:
            raise RuntimeError("protoc failed")
        stubs = {}
        for path in sorted(Path(out, "pagedserve", "v1").glob("*.py")):
            text = re.sub(
                r"^from pagedserve\.v1 import", "from pagedserve.protos import", path.read_text(), flags=re.M
            )
            stubs[path.name] = text
        return stubs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the committed stubs differ")
    args = parser.parse_args()
    stale = []
    for name, text in generate().items():
        target = PROTO_ROOT / name
        if args.check:
            if not target.exists() or target.read_text() != text:
                stale.append(name)
        else:
            target.write_text(text)
    if stale:
        print(f"stale stubs: {', '.join(stale)}; run python -m pagedserve.protos.generate", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
