#!/usr/bin/env bash
# Device call (H100, < 9 min): the serving runs that the allocator's O(pool) free distorted, again: the demo model
# plain and with EAGLE (gpu_serve_probe.sh without py-spy: TTFT at concurrency 1, concurrency 16 twice), then
# full-width V2-Lite (gpu_mixed.sh without its tests: concurrency 64 default and --enable-mixed-chunk, concurrency
# 1 / 16 with mixed chunks and 512-token chunks), and V2-Lite's one-batch prefill at 256 tokens (TTFT's floor). Carry .whl. Returns demo.tgz, v2l.tgz and the summaries.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"; export PYTHONPATH=$PWD:/tmp/site
git log -1 --format='commit %H' 2>/dev/null > "$OUT/commit.txt"
OUT=/tmp/o_demo SPY=${SPY:-0} RUNS="${DEMO_RUNS:-plain eagle nextn}" bash benchmarks/gpu_serve_probe.sh 2>&1 | grep -v "Target directory"
OUT=/tmp/o_v2l TESTS=0 RUNS="${V2L_RUNS:-default mixed levels}" bash benchmarks/gpu_mixed.sh 2>&1 | grep -v "Target directory"
M=/tmp/v2l; timeout 200 python3 -m mlaserve.cli bench one-batch --load-format dummy --model-config $M/config.json \
  --batch-size 1 --input-len 256 --output-len 8 2>&1 | grep -v "Target directory" | tail -10 | tee "$OUT/v2l_one_batch.txt"
(cd /tmp/o_demo && tar czf "$OUT/demo.tgz" .) && (cd /tmp/o_v2l && tar czf "$OUT/v2l.tgz" . && cp summary.txt "$OUT/v2l_summary.txt")
