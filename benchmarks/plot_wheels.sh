#!/usr/bin/env bash
# Add matplotlib's wheels (Python 3.12, manylinux) to ./.whl for the GPU image, which lacks it (`--plot` of
# `bench serving` and benchmarks/ablation.py). Run after ../shared/device/wheels.sh, from the project root. numpy
# and packaging are left out: the image has them, and torch was built against its numpy.
set -euo pipefail
tmp=$(mktemp -d)
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d "$tmp" matplotlib 2>&1 | grep -v "WARNING: Location" || true
mkdir -p .whl
find "$tmp" -name "*.whl" ! -name "numpy-*" ! -name "packaging-*" -exec cp {} .whl/ \;
rm -rf "$tmp"
du -sh .whl
