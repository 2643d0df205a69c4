#!/usr/bin/env bash
# Add xgrammar's wheels (Python 3.12, manylinux) to ./.whl for the GPU image, which lacks it: without it every
# structured-output request aborts there, and tests/engine/test_spec.py's structured row fails. Run after
# ../shared/device/wheels.sh, from the project root. The versions are this machine's (pip show); its other needs
# (numpy, pydantic, torch, transformers, triton, typing-extensions) are in the image or in wheels.sh's set.
set -euo pipefail
version() { python3 -m pip show "$1" 2>/dev/null | sed -n 's/^Version: //p'; }
mkdir -p .whl
for pkg in xgrammar apache-tvm-ffi; do
  v=$(version $pkg)
  [ -n "$v" ] || { echo "$pkg is not installed here: pip install -e '.[test]' first" >&2; exit 1; }
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "$pkg==$v" 2>&1 \
    | grep -v "WARNING: Location" || true
done
du -sh .whl
