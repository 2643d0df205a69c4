#!/usr/bin/env bash
# Piecewise CUDA graphs for prefill (--enable-piecewise-cuda-graph): the GPU rows of tests/test_combinations.py that
# use them, the eager / piecewise A/B of benchmarks/piecewise_ab.py on V2-Lite and V3 4 layers FP8 (full width,
# dummy weights), then `bench one-batch` with the flag (the issue-15 prefill rows: 1 x 4096).
# Usage (nvidia-h100-x1, carry .whl): bash benchmarks/gpu_piecewise.sh [tests|ab|onebatch ...] (default: all)
set -uo pipefail
[ -d .whl ] && python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 MLASERVE_CACHE=/tmp/mlaserve-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PARTS=${*:-tests ab onebatch}
clean() { tr '\r' '\n' | grep -v "^loading weights\|^ *$\|UserWarning\|_warn_once"; }
V2L=$PWD/mlaserve/tools/configs/deepseek-v2-lite.json
python3 -c "import json; d = json.load(open('mlaserve/tools/configs/deepseek-v3.json')); d['num_hidden_layers'] = 4; json.dump(d, open('/tmp/v3_4l.json', 'w'))"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
for part in $PARTS; do
  case $part in
    tests)
      timeout 420 python3 -m pytest -q -p no:cacheprovider tests/test_combinations.py -m "gpu and not multi_gpu" \
        -k "piecewise or graphs-mixed-chunk" 2>&1 | tail -15 | tee "$OUT/tests.txt" ;;
    ab)
      timeout 300 python3 benchmarks/piecewise_ab.py --model-config $V2L 2>&1 | clean | tee "$OUT/ab_v2l.txt"
      timeout 300 python3 benchmarks/piecewise_ab.py --model-config /tmp/v3_4l.json --len 256 4096 2>&1 | clean \
        | tee "$OUT/ab_v3.txt" ;;
    onebatch)
      for cfg in $V2L /tmp/v3_4l.json; do
        for flag in "" "--enable-piecewise-cuda-graph"; do
          timeout 200 python3 -m mlaserve.cli bench one-batch --load-format dummy --model-config $cfg --batch-size 1 \
            --input-len 4096 --output-len 8 $flag --output-file "$OUT/one_batch.md" 2>&1 | grep "^| mlaserve" \
            | sed "s|^|$(basename $cfg) ${flag:-eager} |" | cut -c1-200
        done
      done ;;
  esac
done
