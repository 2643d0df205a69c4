#!/usr/bin/env bash
# A lone request's time to first token in the scheduler (V2-Lite, dummy weights, piecewise graphs), without and with a
# one-token radix hit (`probe_first_token.py --shared-first`), the latter profiled; then the fast-path GPU tests.
# Carry .whl.
set -uo pipefail
[ -d .whl ] && python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M=/tmp/v2l; mkdir -p $M; cp mlaserve/tools/configs/deepseek-v2-lite.json $M/config.json
python3 -m mlaserve.tools.tokenizer $M > /dev/null
timeout 150 python3 benchmarks/probe_first_token.py --model-path $M --piecewise > "$OUT/probe_plain.txt" 2>&1
tail -1 "$OUT/probe_plain.txt"
timeout 150 python3 benchmarks/probe_first_token.py --model-path $M --piecewise --shared-first --profile \
  > "$OUT/probe_shared.txt" 2>&1
tail -1 "$OUT/probe_shared.txt"; grep -A18 "Self CPU %" "$OUT/probe_shared.txt" | cut -c1-60,100-210
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/models/test_gpu_fastpath.py 2>&1 | tail -2 | tee "$OUT/tests.txt"
