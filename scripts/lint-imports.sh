#!/usr/bin/env bash
# Checks the import layers of pyproject.toml's [tool.importlinter] with `lint-imports`.
# import-linter reads a package from one directory, and pagedserve's sub-packages live in four
# folders of the checkout (setuptools' package-dir mapping), so it reads a regular install of the
# checkout made into a temporary directory (about a second); the checkout's root is on the path too,
# for its maintainer tools (benchmarks/, scripts/), which the package must never import.
#   usage: scripts/lint-imports.sh [PYTHON]   (default: .venv/bin/python)
set -euo pipefail
cd "$(dirname "$0")/.."
python=${1:-.venv/bin/python}
target=$(mktemp -d)
trap 'rm -rf "$target"' EXIT
"$python" -m pip install --quiet --no-deps --no-build-isolation --no-compile --target "$target" . 2>/dev/null
PYTHONPATH="$target:$PWD" "$(dirname "$python")/lint-imports" pyproject.toml
