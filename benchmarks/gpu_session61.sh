#!/usr/bin/env bash
# Session of 2026-12-07 (third), one H100 (carry .whl: ../shared/device/wheels.sh):
#   tests:   the one-launch MLA decode chain (kernels/mla_chain.py) and what it touches, the fast path (chain on)
#   probe:   benchmarks/probe_mla_chain.py: one launch against the four, 27 layer calls a graph
#   ab:      bench one-batch V2-Lite bs 1 / 16 (in 256 / out 32), MLASERVE_MLA_CHAIN=1 / 0 alternated, two rounds
#   chunks:  the probe with phase C merging 8 / 16 / 32 partials a step, then bench one-batch V2-Lite bs 1 with the
#            chain at CHUNK_S=32 and off, alternated twice
#   profile: benchmarks/profile_decode.py V2-Lite bs 1 with the chain on and off (kernels of one replayed step)
#   bash benchmarks/gpu_session61.sh PART...
source benchmarks/gpu_v2l_env.sh
cat "$OUT/env.txt"
B="python3 -m mlaserve.cli bench one-batch --load-format dummy --input-len 256 --output-len 32"
for PART in "$@"; do
  echo "=== $PART $(date +%T)"
  case $PART in
    tests)
      MLASERVE_MLA_CHAIN=1 timeout ${TESTS_S:-300} python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/kernels/test_mla_chain.py \
        tests/kernels/test_mla_decode.py tests/kernels/test_mla_absorb.py tests/attention \
        tests/models/test_gpu_fastpath.py} > "$OUT/tests.txt" 2>&1
      grep -a "FAILED\|Error" "$OUT/tests.txt" | head -20; tail -3 "$OUT/tests.txt" ;;
    probe)
      timeout 200 python3 benchmarks/probe_mla_chain.py 2>&1 | grep -av Warning | tee "$OUT/probe.md" ;;
    ab)
      for round in 1 2; do
        for s in 1 0; do
          MLASERVE_MLA_CHAIN=$s timeout 150 $B --model-config $V2L --batch-size ${AB_BS:-1} \
            --output-file "$OUT/ab_r${round}_c$s.md" 2>&1 | grep -a "^|" | grep -av "engine\|---" | sed "s/^/chain=$s /"
        done
      done ;;
    chunks)
      for c in 8 16 32; do
        timeout 100 python3 benchmarks/probe_mla_chain.py --chunk-s $c --splits 128 2>&1 | grep -av Warning \
          | tee -a "$OUT/chunks.md"
      done
      for round in 1 2; do
        MLASERVE_MLA_CHAIN=1 timeout 150 python3 -c "import sys; from mlaserve.kernels import mla_chain; \
mla_chain.CHUNK_S = 32; from mlaserve.cli import main; sys.exit(main(sys.argv[1:]))" ${B#python3 -m mlaserve.cli } \
          --model-config $V2L --batch-size 1 --output-file "$OUT/chunk32_r$round.md" 2>&1 | grep -a "^|" \
          | grep -av "engine\|---" | sed "s/^/chain32 /"
        MLASERVE_MLA_CHAIN=0 timeout 150 $B --model-config $V2L --batch-size 1 --output-file "$OUT/off_r$round.md" 2>&1 \
          | grep -a "^|" | grep -av "engine\|---" | sed "s/^/off /"
      done ;;
    v3)
      for s in 1 0; do
        MLASERVE_MLA_CHAIN=$s timeout 150 $B --model-config $V3_4L --batch-size 1 \
          --output-file "$OUT/v3_c$s.md" 2>&1 | grep -a "^|" | grep -av "engine\|---" | sed "s/^/chain=$s /"
      done ;;
    profile)
      for s in 1 0; do
        MLASERVE_MLA_CHAIN=$s timeout 150 python3 benchmarks/profile_decode.py --bs 1 > "$OUT/profile_c$s.txt" 2>&1
        echo "## MLASERVE_MLA_CHAIN=$s"
        grep -a -A14 "^one replay" "$OUT/profile_c$s.txt" | cut -c1-120
      done ;;
    *) echo "unknown part $PART" ;;
  esac
done
echo "=== done $(date +%T)"
