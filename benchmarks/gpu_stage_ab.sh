#!/usr/bin/env bash
# The decode graph's input staging through numpy (no host aten ops before the replay): GPU tests of the graph
# paths, then one-batch V2-Lite bs 1 / 16, the tree before (carried as .old: `git archive REV mlaserve
# benchmarks/*.py pyproject.toml`, without the demo weights) and the new one alternating, twice each.
# Usage (nvidia-h100-x1, carry .whl and .old): bash benchmarks/gpu_stage_ab.sh
set -uo pipefail
[ -d .whl ] && python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONUNBUFFERED=1 MLASERVE_CACHE=/tmp/mlaserve-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
rm -rf /tmp/old && cp -r .old /tmp/old
new() { PYTHONPATH=$PWD:/tmp/site "$@"; }
old() { (cd /tmp/old && PYTHONPATH=/tmp/old:/tmp/site "$@"); }
new timeout 300 python3 -m pytest -q -p no:cacheprovider tests/models/test_gpu_fastpath.py tests/engine/test_spec.py \
  -k "gpu or greedy_equals or logprobs" 2>&1 | tail -2 | tee "$OUT/tests.txt"
CFG=$PWD/mlaserve/tools/configs/deepseek-v2-lite.json
for round in 1 2; do
  for code in old new; do
    $code timeout 150 python3 -m mlaserve.cli bench one-batch --load-format dummy --model-config $CFG --batch-size 1 16 \
      --input-len 256 --output-len 32 --output-file "$OUT/one_batch_$code.md" 2>&1 | grep "^| mlaserve" \
      | sed "s/^/$code $round /" | cut -c1-120
  done
done
