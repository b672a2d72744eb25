#!/usr/bin/env bash
# Downloads the wheels of scripts/device-wheels.txt (Python 3.12, manylinux x86-64) into .whl/, for
# the GPU machine, which reaches no package registry (scripts/device-env.sh installs them there).
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qxF '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
platforms=()
for n in 17 24 27 28 31 34; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
grep -v '^#' scripts/device-wheels.txt | grep . | while read -r requirement; do
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" --platform manylinux2014_x86_64 --platform any -d .whl "$requirement"
done
ls .whl
