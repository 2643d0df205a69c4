#!/usr/bin/env bash
# Speculative decoding on one GPU (issue 13): the GPU tests of the spec path, then benchmarks/spec_decode.py.
# Run from the repository root on the device: bash benchmarks/gpu_spec.sh  (writes under $OUT)
set -u
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
[ -d .whl ] && python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/gpu.txt"
git rev-parse HEAD > "$OUT/commit.txt" 2>/dev/null || true
PART=${1:-all}
[ "$PART" = all ] && timeout 240 python3 -m pytest -q -x tests/engine/test_spec.py -k gpu -p no:cacheprovider 2>&1 | tail -15 > "$OUT/tests.txt"
[ "$PART" = all ] && cat "$OUT/tests.txt"
if [ "$PART" = all ] || [ "$PART" = cost ]; then
  for layers in 4 6; do
    timeout 200 python3 benchmarks/spec_decode.py cost $layers 2>&1 | tr '\r' '\n' | grep '^{' | tee -a "$OUT/cost.jsonl"
  done
fi
if [ "$PART" = profile ]; then
  for spec in none 3,1,4; do
    timeout 120 python3 benchmarks/spec_decode.py profile 1 $spec 2>&1 | grep -v "loading weights" | tee -a "$OUT/profile.txt"
  done
fi
if [ "$PART" = all ] || [ "$PART" = demo ]; then
  timeout 280 python3 benchmarks/spec_decode.py demo 2>&1 | grep -v "loading weights" | tee -a "$OUT/demo.jsonl"
fi
if [ "$PART" = check ]; then     # the GPU tests of speculation (overlap on, the default) and the 1-GPU combination rows
  timeout 260 python3 -m pytest -q tests/engine/test_spec.py tests/engine/test_spec_tree.py -k gpu -p no:cacheprovider \
    2>&1 | tail -25 | tee "$OUT/tests_spec.txt"
  timeout 280 python3 -m pytest -q tests/test_combinations.py -k "gpu and not tp2 and not dp2" -p no:cacheprovider \
    2>&1 | tail -25 | tee "$OUT/tests_combinations.txt"
fi
if [ "$PART" = map ]; then       # --speculative-token-map: GPU tests, then V3 draft cost with and without a 32k map
  timeout 200 python3 -m pytest -q tests/engine/test_spec.py -k "gpu and map" -p no:cacheprovider \
    2>&1 | tail -5 | tee "$OUT/tests_map.txt"
  for size in ${MAP_SIZES:-0 32768 16384}; do
    timeout 150 python3 benchmarks/spec_decode.py cost 4 512 3 $size 2>&1 | tr '\r' '\n' | grep '^{' \
      | tee -a "$OUT/cost_map.jsonl"       # tqdm's \r-lines would hide a JSON line from a plain grep -v
  done
fi
if [ "$PART" = mapdemo ]; then   # the demo model with draft token maps: accept length and tok/s
  timeout 560 python3 benchmarks/spec_decode.py demo 1536 map 2>&1 | tr '\r' '\n' | grep '^{' | tee -a "$OUT/map.jsonl"
fi
if [ "$PART" = overlap ]; then   # speculation with the overlap scheduler against without it (issue 13)
  timeout 500 python3 benchmarks/spec_decode.py demo 256 overlap 2>&1 | grep -v "loading weights" | tee -a "$OUT/overlap.jsonl"
fi
