#!/usr/bin/env bash
# Session of 2026-12-06 (fourth), one H100 or H200 (carry .whl: ../shared/device/wheels.sh). The prefill's new-token
# attention on cuDNN (mla_prefill.CUDNN_SELF_ATTN) against our Triton flash kernel:
#   sdpa:     benchmarks/probe_sdpa_prefill.py (the attention alone: ours, torch SDPA's backends, cuDNN with lse)
#   tests:    tests/kernels/test_mla_prefill.py (the cuDNN path against the reference and the Triton kernel)
#   ab:       benchmarks/ab_cudnn_prefill.py, V3 4L and V2-Lite 1 x 4096 (and 8192 / 16384), alternated in one runner
#   onebatch: bench one-batch 1 x 4096, V2-Lite and V3 4L (issue 15's prefill rows), the shipped default
#   bash benchmarks/gpu_session56.sh PART...
source benchmarks/gpu_v2l_env.sh
cat "$OUT/env.txt"
for PART in "$@"; do
  echo "=== $PART $(date +%T)"
  case $PART in
    sdpa)
      timeout 300 python3 benchmarks/probe_sdpa_prefill.py 2>&1 | grep -av Warning | tee "$OUT/sdpa.md" ;;
    tests)
      timeout 300 python3 -m pytest -q -x tests/kernels/test_mla_prefill.py > "$OUT/tests.txt" 2>&1; tail -4 "$OUT/tests.txt" ;;
    ab)
      for run in "$V3_4L 4096" "$V2L 4096" "$V3_4L 8192" "$V3_4L 16384" "$V2L 16384"; do
        set -- $run
        timeout 200 python3 benchmarks/ab_cudnn_prefill.py --model-config $1 --len $2 2>&1 | grep -a "^|\|logits\|Error" \
          | tee -a "$OUT/ab.md"
      done ;;
    onebatch)
      for cfg in $V2L $V3_4L; do
        timeout 200 python3 -m mlaserve.cli bench one-batch --load-format dummy --model-config $cfg --batch-size 1 \
          --input-len 4096 --output-len 4 > "$OUT/onebatch_$(basename $cfg .json).log" 2>&1
        grep -av "^{\|Warning\|warn" "$OUT/onebatch_$(basename $cfg .json).log" | tail -12 | cut -c1-260
      done ;;
    *) echo "unknown part $PART" ;;
  esac
done
echo "=== done $(date +%T)"
