#!/usr/bin/env bash
# Session of 2026-12-02 (second), one H200 (carry .whl: ../shared/device/wheels.sh, then benchmarks/xgrammar_wheels.sh).
# The L2 prefetch parts (tests, probe, ab, profile) ran at b516118 / cae3d2b and went with the code
# (benchmarks/results/l2-prefetch-h200.md). Left:
#   split:  benchmarks/probe_step_split.py, V2-Lite and V3 4L at bs 1 / 64 (the synchronous step beside its graph)
#   warps:  last session's repeat: the H=16 MLA decode at 4 warps against 8, bs 64 at 4096 tokens, alternated
#   gputests: the kernel, attention, layer and model tests on the GPU, the speculative GPU rows (the MLA decode tests
#             alone: gpu_session47.sh mlatests)
#   bash benchmarks/gpu_session48.sh PART...
source benchmarks/gpu_v2l_env.sh
cat "$OUT/env.txt"
for PART in "$@"; do
  echo "=== $PART $(date +%T)"
  case $PART in
    split)
      timeout 200 python3 benchmarks/probe_step_split.py --model-config $V2L --bs 1 64 > "$OUT/split_v2l.txt" 2>&1
      grep -v "^$" "$OUT/split_v2l.txt" | grep -v "loading weights" | head -30
      timeout 200 python3 benchmarks/probe_step_split.py --model-config $V3_4L --bs 1 64 > "$OUT/split_v3.txt" 2>&1
      grep -v "^$" "$OUT/split_v3.txt" | grep -v "loading weights" | head -30 ;;
    warps)
      old="import sys, mlaserve.kernels.mla_decode as m; m.CONFIGS[16] = m.MLADecodeConfig(16, 64, 4, 2)"
      for tag in old new old new; do
        patch="import sys"; [ $tag = old ] && patch="$old"
        echo "### $tag"
        timeout 150 python3 -c "$patch; from mlaserve.cli import main; sys.exit(main())" bench one-batch \
          --load-format dummy --input-len 4096 --output-len 16 --model-config "$V2L" --batch-size 64 \
          --output-file "$OUT/warps_$tag.md" 2>&1 | grep "^| mlaserve" | tail -1
      done ;;
    gputests)
      timeout 520 python3 -m pytest -q -p no:cacheprovider -rf tests/kernels tests/attention tests/layers tests/models \
        "tests/engine/test_spec.py" -k "not test_spec.py or cuda or gpu" > "$OUT/gpu_tests.txt" 2>&1
      tail -15 "$OUT/gpu_tests.txt" ;;
  esac
done
