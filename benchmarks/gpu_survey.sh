#!/usr/bin/env bash
# Issue 15 survey on one H100 (carry .whl): true per-kernel decode times (PDL off, so a kernel's time does not include
# its wait), the V3 4L FP8 prefill's kernels, and one mixed step's host and device time.
#   bash benchmarks/gpu_survey.sh [decode|prefill|mixed|all]
source benchmarks/gpu_v2l_env.sh
PART=${1:-all}
cat "$OUT/env.txt"
if [ "$PART" = decode ] || [ "$PART" = all ]; then
  for spec in "v2l 1 $V2L" "v2l 64 $V2L" "v3 1 /tmp/v3_4l.json" "v3 64 /tmp/v3_4l.json"; do
    set -- $spec
    MLASERVE_PDL=0 timeout 150 python3 benchmarks/profile_decode.py --model-config $3 --bs $2 > "$OUT/dec_$1_bs$2.txt" 2>&1
    grep -A25 "kernels per step" "$OUT/dec_$1_bs$2.txt" | head -28
  done
fi
if [ "$PART" = prefill ] || [ "$PART" = all ]; then
  timeout 200 python3 benchmarks/profile_prefill.py --model-config /tmp/v3_4l.json --len 4096 > "$OUT/prefill_v3_4096.txt" 2>&1
  head -30 "$OUT/prefill_v3_4096.txt"
fi
if [ "$PART" = mixed ] || [ "$PART" = all ]; then
  timeout 200 python3 benchmarks/probe_mixed_step.py --model-path $M --piecewise --mixed --arrive 1 --profile \
    > "$OUT/mixed_profile.txt" 2>&1
  grep -v "^$" "$OUT/mixed_profile.txt" | tail -50
fi
