#!/usr/bin/env bash
# Session of 2026-12-02 (third), one H200 (carry .whl: ../shared/device/wheels.sh). Issue 15's V3 prefill: the fused MoE's grouped GEMMs at prefill sizes.
#   sweep:    benchmarks/sweep_moe_prefill.py at 4096 tokens (V3 FP8, V2-Lite bf16), beside the kernel before this
#             change (carry benchmarks/_baseline_fused_moe.py: `git show 4975120:mlaserve/kernels/fused_moe.py`)
#   moetests: tests/kernels/test_fused_moe.py on the GPU
#   models:   the model tests on the GPU path (greedy equality with the reference in fp32, log-probs against HF)
#   ab:       bench one-batch with the kernel before this change (the baseline file's _fused_moe) and this one,
#             alternated: V3 4L FP8 1 x 4096 prefill twice each, then V3 4L and V2-Lite decode at bs 1 / 64 once each
#   bash benchmarks/gpu_session49.sh PART...
source benchmarks/gpu_v2l_env.sh
cat "$OUT/env.txt"
for PART in "$@"; do
  echo "=== $PART $(date +%T)"
  case $PART in
    sweep)
      base=""; [ -f benchmarks/_baseline_fused_moe.py ] && base="--baseline benchmarks/_baseline_fused_moe.py"
      timeout 420 python3 benchmarks/sweep_moe_prefill.py --tokens ${SWEEP_TOKENS:-4096} ${SWEEP_ARGS:-} $base \
        > "$OUT/sweep.md" 2>&1
      grep -v "^$" "$OUT/sweep.md" | grep -v Warning | tail -80 ;;
    moetests)
      timeout 240 python3 -m pytest -q -p no:cacheprovider -rf tests/kernels/test_fused_moe.py > "$OUT/moe_tests.txt" 2>&1
      tail -6 "$OUT/moe_tests.txt" ;;
    models)
      timeout 300 python3 -m pytest -q -p no:cacheprovider -rf tests/models/test_gpu_fastpath.py > "$OUT/model_tests.txt" 2>&1
      tail -4 "$OUT/model_tests.txt" ;;
    ab)
      old="import importlib.util as u, mlaserve.kernels.fused_moe as fm; s = u.spec_from_file_location('old_fm',
 'benchmarks/_baseline_fused_moe.py'); o = u.module_from_spec(s); s.loader.exec_module(o); o.CONFIG_DIR = fm.CONFIG_DIR
fm._fused_moe = o._fused_moe"
      one() {  # one TAG NAME ARGS...: bench one-batch with the kernel TAG names
        local tag=$1 name=$2; shift 2
        patch="import sys"; [ $tag = before ] && patch="$old"
        timeout 150 python3 -c "$patch
import sys; from mlaserve.cli import main; sys.exit(main())" bench one-batch --load-format dummy "$@" \
          --output-file "$OUT/ab_${name}_$tag.md" > "$OUT/ab_${name}_$tag.log" 2>&1
        grep "^| mlaserve" "$OUT/ab_${name}_$tag.log" | sed "s/^/$name $tag /" || tail -3 "$OUT/ab_${name}_$tag.log"
      }
      i=0
      for tag in before now before now; do
        i=$((i + 1))
        one $tag prefill_v3_$i --model-config $V3_4L --batch-size 1 --input-len 4096 --output-len 4
      done
      for tag in before now; do
        one $tag decode_v3 --model-config $V3_4L --batch-size 1 64 --input-len 256 --output-len 32
        one $tag decode_v2l --model-config $V2L --batch-size 1 64 --input-len 256 --output-len 32
      done ;;
  esac
done
