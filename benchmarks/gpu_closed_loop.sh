#!/usr/bin/env bash
# Issue 15 serving targets on one H100 (carry .whl): the closed-loop load of `bench serving` (192 prompts of 128-256
# tokens, 64-128 new, concurrency 64) on the real scheduler in process (benchmarks/probe_closed_loop.py), V2-Lite
# dummy weights, three ways: piecewise graphs; + mixed chunk; + mixed chunk with chunks of 512.
#   bash benchmarks/gpu_closed_loop.sh [EXTRA PROBE FLAGS...]
source benchmarks/gpu_v2l_env.sh
cat "$OUT/env.txt"
for a in ${CONFIGS:-"--piecewise" "--piecewise --mixed" "--piecewise --mixed --chunk 512"}; do
  tag=$(echo "$a" | tr -d '-' | tr ' ' '_')
  echo "### $a $*"
  timeout 200 python3 benchmarks/probe_closed_loop.py --model-path $M $a "$@" > "$OUT/closed_$tag.txt" 2>&1
  grep -v "^loading\|Warn\|warn" "$OUT/closed_$tag.txt" | tail -22
done
