#!/usr/bin/env bash
# Session of 2026-12-07 (sixth), one H100 (carry .whl: ../shared/device/wheels.sh): the GPU tests at the new default
# (the attention chain's bs-1 graph on, mla_chain.CHAIN_MAX_CONTEXT 2048), then issue 15's table at it
#   tests:  every GPU-marked test of tests/models (the fast path's greedy equality, the demo model, the FP8 KV cache);
#           not tests/server: its structured-output module imports jsonschema, which the device image lacks
#   combos: test_combinations.py's one-GPU rows that decode through the graphs (graphs, compile, speculation, tree
#           drafts, mixed chunk, piecewise), within COMBOS_S seconds
#   then:   benchmarks/gpu_session53.sh's parts (table serve v3 prefill) at this tree
#   bash benchmarks/gpu_session64.sh PART...
source benchmarks/gpu_v2l_env.sh
for PART in "$@"; do
  echo "=== $PART $(date +%T)"
  case $PART in
    tests)
      timeout ${TESTS_S:-240} python3 -m pytest -q -p no:cacheprovider -rf -m gpu tests/models \
        > "$OUT/tests.txt" 2>&1
      grep -a "^FAILED\|^ERROR" "$OUT/tests.txt" | head -10; tail -1 "$OUT/tests.txt" ;;
    combos)
      timeout ${COMBOS_S:-200} python3 -m pytest -q -p no:cacheprovider -rf tests/test_combinations.py \
        -k "${COMBOS_K:-[graphs] or [graphs-compile] or [graphs-spec] or [graphs-mixed-chunk] or [piecewise] or [graphs-compile-tree]}" \
        > "$OUT/combos.txt" 2>&1
      grep -a "^FAILED\|^ERROR\|passed\|failed" "$OUT/combos.txt" | tail -8 ;;
    table|serve|v3|prefill)
      bash benchmarks/gpu_session53.sh $PART 2>&1 | grep -av "^=== done\|no xgrammar\|NVIDIA" ;;
    *) echo "unknown part $PART" ;;
  esac
done
echo "=== done $(date +%T)"
