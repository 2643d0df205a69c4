#!/usr/bin/env bash
# Session of 2026-12-02 (sixth), one H200 (carry .whl: ../shared/device/wheels.sh). Issue 15's prefill: the fused MoE's
# grouped GEMMs with TMA (the table key TMA: weights through TMA descriptors, h in the sorted layout).
# The TMA path was removed after these calls: `sweep` and `probe` need the tree at 2502103 (git checkout 2502103).
#   tests:   tests/kernels/test_fused_moe.py and tests/layers/test_moe.py on the GPU (the TMA tests among them at 2502103)
#   sweep:   benchmarks/sweep_moe_prefill.py --tma at SWEEP_TOKENS (default 4096) for SWEEP_MODELS (default both):
#            the tuned tiles with and without TMA, a TMA tile list, the fastest TMA pair; PICK lines to $OUT/picks.txt
#   abtable: benchmarks/ab_moe_table.py --picks $OUT/picks.txt: 1 x 4096 prefill, V3 4L then V2-Lite, shipped tables
#            and the picks alternated in one process (AB_LENS: prompt lengths, default 4096)
#   probe:   benchmarks/probe_moe_tma.py, one case a process (a fault ends only its own): the V3 GEMMs that faulted in
#            the first call's sweep, by expert count, tile, GEMM and descriptor rank
#   profshared: benchmarks/gpu_session51.sh's part of that name (V2-Lite's shared experts side by side against one
#            GEMM pair each, kernel profiles alternated)
#   bash benchmarks/gpu_session52.sh PART...
source benchmarks/gpu_v2l_env.sh
cat "$OUT/env.txt"
for PART in "$@"; do
  echo "=== $PART $(date +%T)"
  case $PART in
    tests)
      timeout ${TESTS_S:-200} python3 -m pytest -q -p no:cacheprovider -rf tests/kernels/test_fused_moe.py tests/layers/test_moe.py \
        > "$OUT/tests.txt" 2>&1
      tail -6 "$OUT/tests.txt" ;;
    sweep)
      for m in ${SWEEP_MODELS:-deepseek-v3 deepseek-v2-lite}; do
        timeout ${SWEEP_S:-240} python3 benchmarks/sweep_moe_prefill.py --tma --tokens ${SWEEP_TOKENS:-4096} \
          --models $m >> "$OUT/sweep.txt" 2>&1
        echo "sweep $m rc $?"
      done
      grep -a "^PICK" "$OUT/sweep.txt" >> "$OUT/picks.txt"
      grep -aE "^\| now \(tuned\)|^fused_moe|^PICK|failed" "$OUT/sweep.txt" ;;
    abtable)
      for m in $V3_4L $V2L; do
        for len in ${AB_LENS:-4096}; do
          timeout 150 python3 benchmarks/ab_moe_table.py --picks "$OUT/picks.txt" --model-config $m --len $len \
            > "$OUT/abtable.log" 2>&1
          grep -aoE "(picked .*|round .*)$" "$OUT/abtable.log" || tail -3 "$OUT/abtable.log"
        done
      done ;;
    profshared)
      bash benchmarks/gpu_session51.sh profshared 2>&1 | grep -v "^no xgrammar\|^NVIDIA" ;;
    probe)
      while read -r args; do
        [ -z "$args" ] && continue
        timeout 60 python3 benchmarks/probe_moe_tma.py $args > "$OUT/probe.log" 2>&1
        grep -a "^OK" "$OUT/probe.log" || echo "FAIL $args: $(grep -aE "Error|error" "$OUT/probe.log" | tail -1)"
      done <<< "${PROBES:-"--experts 256 --rank 2
--experts 256 --rank 3
--experts 128 --rank 2
--experts 256 --gemm down --rank 2
--experts 256 --gemm down --rank 3
--experts 256 --tile 64,256,8,3 --rank 3
--experts 64 --bf16 --tile 128,256,8,4 --rank 3"}" ;;
  esac
done
