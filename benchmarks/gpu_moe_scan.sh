#!/usr/bin/env bash
# Issue 15: the fused MoE's expert scan (no align launch from 2 tokens to EXPERT_SCAN_MAX_SLOTS slots) on one GPU
# (carry .whl and .old: a `git archive` of the tree before it, without mlaserve/demo and benchmarks/results).
#   bench: benchmarks/bench_moe_scan.py (scan against the sorted layout, V2-Lite and V3 shapes, 2-128 tokens)
#   tests: the fused-MoE kernel tests and the fast path's greedy equality on the GPU
#   ab:    bench one-batch V2-Lite at bs 4 / 16 / 32 (the scan's sizes), the old tree and this one alternated twice
#   bash benchmarks/gpu_moe_scan.sh [bench|tests|ab|all]...
source benchmarks/gpu_v2l_env.sh
cat "$OUT/env.txt"
git log -1 --format=%h 2>/dev/null
ob() {  # ob TAG TREE CONFIG BATCH_SIZES...: one-batch from the source tree TREE
  local tag=$1 tree=$2 cfg=$3; shift 3
  echo "### $tag"
  (cd "$tree" && PYTHONPATH=$PWD:/tmp/site timeout 200 python3 -m mlaserve.cli bench one-batch --load-format dummy \
    --input-len 256 --output-len 32 --model-config "$cfg" --batch-size "$@" --output-file "$OUT/one_batch_$tag.md" \
    2>&1 | grep "^|" | tail -3)
}
for PART in "${@:-all}"; do
  if [ "$PART" = bench ] || [ "$PART" = all ]; then
    timeout 200 python3 benchmarks/bench_moe_scan.py --tokens 2 4 8 16 32 64 > "$OUT/moe_scan.txt" 2>&1; grep -v "^{" "$OUT/moe_scan.txt" | tail -24
  fi
  if [ "$PART" = tests ] || [ "$PART" = all ]; then
    timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_fused_moe.py 2>&1 | tail -4 \
      | tee "$OUT/tests_fused_moe.txt"
    timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/models/test_gpu_fastpath.py 2>&1 | tail -3 \
      | tee "$OUT/tests_fastpath.txt"
  fi
  if [ "$PART" = ab ] || [ "$PART" = all ]; then
    for i in 1 2; do
      ob v2l_old$i .old "$PWD/$V2L" 4 16 32
      ob v2l_new$i . "$PWD/$V2L" 4 16 32
    done
  fi
done
