#!/usr/bin/env bash
# Session of 2026-12-07 (second), one H100 (carry .whl: ../shared/device/wheels.sh):
#   tests:   the GPU tests of the shared experts in the router's launch (MLASERVE_SHARED_IN_ROUTER), the kernels they
#            touch and the fast path (greedy equality with CUDA graphs)
#   ab:      bench one-batch V2-Lite bs 1 (in 256 / out 32), MLASERVE_SHARED_IN_ROUTER=1 / 0 alternated, three rounds
#   sweep:   benchmarks/sweep_shared_in_router.py: the shared programs' values x warps, and the switch off, twice
#   profile: benchmarks/profile_decode.py V2-Lite bs 1 with the switch on and off (kernels of one replayed step)
#   sdpa:    benchmarks/probe_sdpa_prefill.py at 128 heads, 4096 / 16384 tokens (cuDNN's and our error against fp32)
#   bash benchmarks/gpu_session60.sh PART...
source benchmarks/gpu_v2l_env.sh
cat "$OUT/env.txt"
B="python3 -m mlaserve.cli bench one-batch --load-format dummy --input-len 256 --output-len 32"
for PART in "$@"; do
  echo "=== $PART $(date +%T)"
  case $PART in
    tests)
      timeout ${TESTS_S:-240} python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/kernels/test_moe_topk.py \
        tests/layers/test_moe.py tests/kernels/test_fused_moe.py tests/models/test_gpu_fastpath.py} > "$OUT/tests.txt" 2>&1
      tail -6 "$OUT/tests.txt" ;;
    ab)
      for round in 1 2 3; do
        for s in 1 0; do
          MLASERVE_SHARED_IN_ROUTER=$s timeout 120 $B --model-config $V2L --batch-size 1 \
            --output-file "$OUT/ab_r${round}_s$s.md" 2>&1 | grep -a "^|" | tail -1 | sed "s/^/shared_in_router=$s /"
        done
      done ;;
    sweep)    # the shared programs' tile: values a program holds x warps, twice each, alternated
      for round in 1 2; do
        for v in "16384 8" "8192 8" "8192 4" "32768 8" "0 0"; do
          set -- $v
          if [ $1 = 0 ]; then sw="MLASERVE_SHARED_IN_ROUTER=0"; args=""; else sw=""; args="--rows-values $1 --warps $2"; fi
          env $sw timeout 80 python3 benchmarks/sweep_shared_in_router.py $args --load-format dummy --input-len 256 \
            --output-len 32 --model-config $V2L --batch-size 1 2>&1 | grep -a "^|\|^shared" | tail -2 | tr '\n' ' ' \
            | sed "s/^/[$1 $2] /"; echo
        done
      done ;;
    profile)
      for s in 1 0; do
        echo "## MLASERVE_SHARED_IN_ROUTER=$s" >> "$OUT/profile.txt"
        MLASERVE_SHARED_IN_ROUTER=$s timeout 120 python3 benchmarks/profile_decode.py --bs 1 2>&1 | grep -av Warning \
          | tail -16 >> "$OUT/profile.txt"
      done
      cat "$OUT/profile.txt" | cut -c1-150 ;;
    sdpa)
      timeout 150 python3 benchmarks/probe_sdpa_prefill.py --heads 128 --tokens 4096 16384 2>&1 | grep -av Warning \
        | tee "$OUT/sdpa.md" ;;
    *) echo "unknown part $PART" ;;
  esac
done
echo "=== done $(date +%T)"
