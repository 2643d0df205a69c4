#!/usr/bin/env bash
# Session of 2026-12-07 (fifth), one H100 (carry .whl: ../shared/device/wheels.sh): the attention chain's bs-1 graph
# (MLASERVE_MLA_CHAIN=1) for contexts up to mla_chain.CHAIN_MAX_CONTEXT (engine/graph.py);
# ran 2026-12-07 (sixth session): benchmarks/results/chain-graph-h100.md
#   tests: GPU tests of the chain, and the fast path's greedy equality (the chain graph, then the four launches')
#   probe: benchmarks/probe_mla_chain.py at contexts around the cap, the chain at the cap graph's split counts (16 for
#          1024 tokens, 32 for 2048) and the four launches at a server graph's 128
#   ab:    bench one-batch V2-Lite bs 1 in 256 / out 32, MLASERVE_MLA_CHAIN=1 (chain graph) and 0, alternated
#          twice: as sized by the run (context 296), as a server's (--context-length 32768: the four launches' graph
#          at 128 splits) and at input 900 (the chain graph's last sizes)
#   bash benchmarks/gpu_session63.sh PART...
source benchmarks/gpu_v2l_env.sh
cat "$OUT/env.txt"
B="python3 -m mlaserve.cli bench one-batch --load-format dummy --output-len 32 --model-config $V2L --batch-size 1"
row() {  # row NAME CHAIN OUTFILE ARGS...
  local name=$1 c=$2 file=$3; shift 3
  MLASERVE_MLA_CHAIN=$c timeout 120 $B "$@" --output-file "$file" 2>&1 | grep -a "^|" | grep -av "engine\|---" \
    | sed "s/^/$name /"
}
for PART in "$@"; do
  echo "=== $PART $(date +%T)"
  case $PART in
    tests)
      MLASERVE_MLA_CHAIN=1 timeout ${TESTS_S:-200} python3 -m pytest -q -p no:cacheprovider tests/kernels/test_mla_chain.py \
        tests/models/test_gpu_fastpath.py -k "${TESTS_K:-chain or greedy_equals or pad_correctly}" > "$OUT/tests.txt" 2>&1
      grep -a "^FAILED\|Error" "$OUT/tests.txt" | head -10; tail -1 "$OUT/tests.txt" ;;
    probe)
      timeout 150 python3 benchmarks/probe_mla_chain.py --ctx ${CTXS:-256 512 1024 1536 2048} --splits 128 16 32 2>&1 \
        | grep -av Warning | tee "$OUT/probe.md" ;;
    ab)
      for round in 1 2; do
        for c in 1 0; do
          row "r$round chain=$c ctx296" $c "$OUT/ab_r${round}_c${c}.md" --input-len 256
          row "r$round chain=$c ctx32768" $c "$OUT/ab_server_r${round}_c${c}.md" --input-len 256 --context-length 32768
        done
      done
      for c in 1 0; do row "chain=$c in900" $c "$OUT/ab_900_c${c}.md" --input-len 900; done ;;
    *) echo "unknown part $PART" ;;
  esac
done
echo "=== done $(date +%T)"
