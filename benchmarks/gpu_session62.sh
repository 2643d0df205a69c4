#!/usr/bin/env bash
# Session of 2026-12-07 (fourth), one H100 (carry .whl: ../shared/device/wheels.sh):
#   tests:  the one-token MoE preload / early release (kernels/fused_moe.py) and the chain's stamps (GPU tests)
#   stamps: benchmarks/probe_mla_chain.py --stamps: where the one-launch chain's time goes, 256 / 4096 tokens
#   (ab and v3 ran at e66bbfe: their MLASERVE_MOE_* switches were removed after them, with the preload they set)
#   ab:     bench one-batch V2-Lite bs 1 (in 256 / out 32) under VARIANTS (default below), two rounds alternated
#   v3:     bench one-batch V3 4L FP8 bs 1 under the MoE variants, once each
#   sweep:  the stamps at cache tiles of 64 / 32 / 16 tokens and 8 / 4 warps (CONFIGS: "BLOCK_N:WARPS ...")
#   inmodel: benchmarks/probe_chain_in_model.py: the chain's stamps inside the V2-Lite bs-1 decode graph, tiles of BNS
#   newold: GPU tests of the chain and what it shares (new tree), then the stamps (alone and in the model) of the new
#           tree and of .old (carried: a git archive of the tree before), then bench one-batch V2-Lite bs 1 with the
#           chain (new), the chain (.old) and without, two rounds
#   final:  GPU tests of the chain (and the fast path's greedy equality with it on), then bench one-batch V2-Lite bs 1
#           with the chain (new tree), the chain (.old) and without, two rounds
#   abbn:   bench one-batch V2-Lite bs 1 with the chain at the tiles of BNS (default "32 16") and off, two rounds
#   bash benchmarks/gpu_session62.sh PART...
source benchmarks/gpu_v2l_env.sh
cat "$OUT/env.txt"
B="python3 -m mlaserve.cli bench one-batch --load-format dummy --input-len 256 --output-len 32"
# a variant: NAME=ENV1,ENV2 (each ENV one of the switches set to 1; the others 0)
VARIANTS=${VARIANTS:-"base= preload=MLASERVE_MOE_PRELOAD early=MLASERVE_MOE_PRELOAD,MLASERVE_MOE_EARLY_RELEASE \
chain=MLASERVE_MLA_CHAIN all=MLASERVE_MLA_CHAIN,MLASERVE_MOE_PRELOAD,MLASERVE_MOE_EARLY_RELEASE"}
run_variant() {  # run_variant NAME=SWITCHES OUTFILE ARGS...
  local name=${1%%=*} on=${1#*=} file=$2; shift 2
  local envs="MLASERVE_MLA_CHAIN=0 MLASERVE_MOE_PRELOAD=0 MLASERVE_MOE_EARLY_RELEASE=0"
  for s in ${on//,/ }; do envs="$envs $s=1"; done
  env $envs timeout 150 $B "$@" --output-file "$file" 2>&1 | grep -a "^|" | grep -av "engine\|---" | sed "s/^/$name /"
}
for PART in "$@"; do
  echo "=== $PART $(date +%T)"
  case $PART in
    tests)
      timeout ${TESTS_S:-300} python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/kernels/test_fused_moe.py \
        tests/kernels/test_mla_chain.py} > "$OUT/tests.txt" 2>&1
      grep -a "FAILED\|Error" "$OUT/tests.txt" | head -20; tail -3 "$OUT/tests.txt" ;;
    stamps)
      timeout 200 python3 benchmarks/probe_mla_chain.py --stamps 2>&1 | grep -av Warning | tee "$OUT/stamps.md" ;;
    ab)
      for round in 1 2; do
        for v in $VARIANTS; do run_variant "$v" "$OUT/ab_r${round}_${v%%=*}.md" --model-config $V2L --batch-size 1; done
      done ;;
    v3)
      for v in base= early=MLASERVE_MOE_PRELOAD,MLASERVE_MOE_EARLY_RELEASE; do
        run_variant "$v" "$OUT/v3_${v%%=*}.md" --model-config $V3_4L --batch-size 1
      done ;;
    sweep)
      for cfg in ${CONFIGS:-64:8 32:8 16:8 64:4 32:4}; do
        timeout 120 python3 benchmarks/probe_mla_chain.py --stamps --block-n ${cfg%%:*} --warps ${cfg#*:} 2>&1 \
          | grep -av Warning | tee -a "$OUT/sweep.md"
        timeout 120 python3 benchmarks/probe_mla_chain.py --splits 128 --block-n ${cfg%%:*} --warps ${cfg#*:} 2>&1 \
          | grep -av Warning | tee -a "$OUT/sweep.md"
      done ;;
    abbn)
      for round in 1 2; do
        for bn in ${BNS:-32 16}; do
          MLASERVE_MLA_CHAIN=1 timeout 150 python3 -c "import sys; from mlaserve.kernels import mla_chain; \
mla_chain.CHAIN_BLOCK_N = $bn; from mlaserve.cli import main; sys.exit(main(sys.argv[1:]))" ${B#python3 -m mlaserve.cli } \
            --model-config $V2L --batch-size 1 --output-file "$OUT/bn${bn}_r$round.md" 2>&1 | grep -a "^|" \
            | grep -av "engine\|---" | sed "s/^/chain bn=$bn /"
        done
        run_variant base= "$OUT/off_r$round.md" --model-config $V2L --batch-size 1
      done ;;
    inmodel)
      for bn in ${BNS:-64 32 16}; do
        timeout 150 python3 benchmarks/probe_chain_in_model.py --block-n $bn -- ${B#python3 -m mlaserve.cli bench one-batch } \
          --model-config $V2L --batch-size 1 --output-file "$OUT/inmodel_bn$bn.md" 2>&1 | grep -av Warning \
          | grep -a "^|\|^in the model\|Error\|error" | grep -av "^|---" | tee -a "$OUT/inmodel.md"
      done ;;
    newold)
      MLASERVE_MLA_CHAIN=1 timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_mla_chain.py \
        tests/kernels/test_mla_decode.py tests/kernels/test_rope.py tests/kernels/test_mla_absorb.py \
        tests/models/test_gpu_fastpath.py > "$OUT/tests.txt" 2>&1
      grep -a "FAILED\|Error" "$OUT/tests.txt" | head -20; tail -2 "$OUT/tests.txt"
      for tree in new old; do
        root=$PWD; [ $tree = old ] && root=$PWD/.old
        PYTHONPATH=$root:/tmp/site timeout 100 python3 $root/benchmarks/probe_mla_chain.py --stamps --splits 128 2>&1 \
          | grep -a "^| [0-9]" | sed "s/^/$tree alone /" | tee -a "$OUT/newold.md"
        PYTHONPATH=$root:/tmp/site timeout 150 python3 $root/benchmarks/probe_chain_in_model.py -- \
          ${B#python3 -m mlaserve.cli bench one-batch } --model-config $V2L --batch-size 1 2>&1 \
          | grep -a "^| [0-9]\|^| mlaserve" | sed "s/^/$tree in model /" | tee -a "$OUT/newold.md"
      done
      for round in 1 2; do
        for tree in new old off; do
          root=$PWD; [ $tree = old ] && root=$PWD/.old
          c=1; [ $tree = off ] && c=0
          (cd $root && PYTHONPATH=$root:/tmp/site MLASERVE_MLA_CHAIN=$c timeout 150 $B --model-config $PWD/$V2L \
            --batch-size 1 --output-file "$OUT/newold_r${round}_$tree.md" 2>&1) | grep -a "^|" \
            | grep -av "engine\|---" | sed "s/^/$tree /"
        done
      done ;;
    final)
      MLASERVE_MLA_CHAIN=1 timeout 110 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_mla_chain.py \
        tests/models/test_gpu_fastpath.py -k "chain or greedy_equals" > "$OUT/tests.txt" 2>&1
      grep -a "^FAILED\|Error" "$OUT/tests.txt" | head -10; tail -1 "$OUT/tests.txt"
      for round in 1 2; do
        for tree in new old off; do
          root=$PWD; [ $tree = old ] && root=$PWD/.old
          c=1; [ $tree = off ] && c=0
          (cd $root && PYTHONPATH=$root:/tmp/site MLASERVE_MLA_CHAIN=$c timeout 60 $B --model-config $V2L \
            --batch-size 1 --output-file "$OUT/final_r${round}_$tree.md" 2>&1) | grep -a "^|" \
            | grep -av "engine\|---" | sed "s/^/$tree /"
        done
      done ;;
    *) echo "unknown part $PART" ;;
  esac
done
echo "=== done $(date +%T)"
