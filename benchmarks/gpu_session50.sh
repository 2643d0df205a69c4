#!/usr/bin/env bash
# Session of 2026-12-02 (fourth), one H200 (carry .whl: ../shared/device/wheels.sh). Issue 15's V3 prefill.
#   tests:   the GPU tests of the norm / activation / FP8 GEMM kernels and the quantise-ahead entries, the model's
#            GPU path (greedy equality with the reference in fp32, log-probs against HF) and the fused-vs-unfused
#            FP8 model test
#   ab:      bench one-batch with the norms / SwiGLU quantising for the next FP8 GEMM off (quant_plan patched to
#            None: fp8_linear's own quantisation pass) and on, alternated: V3 4L FP8 1 x 4096 prefill twice each,
#            then V3 4L decode at bs 1 / 16 / 64 once each
#   profile: benchmarks/profile_prefill.py, V3 4L 1 x 4096 (kernel list, GPU idle)
#   tune:    tune fused-moe, V3 FP8 at TUNE_SIZES (default 1024 2048 4096 8192) with the down pass -> $OUT/tuned
#   tuneab:  benchmarks/ab_moe_tables.py: the shipped V3 FP8 table against $OUT/tuned's, alternated
#   combine: bench one-batch 1 x 4096 prefill with the MoE combine's row kernel off (SUM_ROWS_MIN_TOKENS patched past
#            any T: torch.sum) and on, alternated twice: V2-Lite, then V3 4L (not run yet: the next session's)
#   flash:   benchmarks/sweep_mla_prefill.py (the flash prefill kernel's tiles at the bench shapes)
#   bash benchmarks/gpu_session50.sh PART...
source benchmarks/gpu_v2l_env.sh
cat "$OUT/env.txt"
off="import mlaserve.kernels.fp8_gemm as g; g.quant_plan = lambda m, x, w_q: None"
one() {  # one TAG NAME ARGS...: bench one-batch with the quantise-ahead path TAG (off / on)
  local tag=$1 name=$2; shift 2
  patch="import sys"; [ $tag = off ] && patch="$off"
  timeout 170 python3 -c "$patch
import sys; from mlaserve.cli import main; sys.exit(main())" bench one-batch --load-format dummy "$@" \
    --output-file "$OUT/ab_${name}_$tag.md" > "$OUT/ab_${name}_$tag.log" 2>&1
  grep "^| mlaserve" "$OUT/ab_${name}_$tag.log" | sed "s/^/$name $tag /" || tail -3 "$OUT/ab_${name}_$tag.log"
}
for PART in "$@"; do
  echo "=== $PART $(date +%T)"
  case $PART in
    retest)   # the two tests fixed after the first call
      timeout 200 python3 -m pytest -q -p no:cacheprovider -rf tests/layers/test_ops.py \
        "tests/models/test_deepseek_vs_hf.py::test_fp8_quantising_norms_change_no_bit" 2>&1 | tail -3 ;;
    tests)
      timeout 400 python3 -m pytest -q -p no:cacheprovider -rf tests/kernels/test_norm.py tests/kernels/test_activation.py \
        tests/kernels/test_fp8_gemm.py tests/kernels/test_quant.py tests/layers/test_ops.py tests/models/test_gpu_fastpath.py \
        "tests/models/test_deepseek_vs_hf.py::test_fp8_quantising_norms_change_no_bit" > "$OUT/tests.txt" 2>&1
      tail -8 "$OUT/tests.txt" ;;
    ab)
      ab_v3_4l one off on ;;
    profile)
      timeout 200 python3 benchmarks/profile_prefill.py --model-config $V3_4L --len 4096 > "$OUT/prefill_v3_4096.txt" 2>&1
      grep -v "loading\|Warn\|warn\|no tuned" "$OUT/prefill_v3_4096.txt" | head -40 ;;
    tune)
      timeout ${TUNE_TIMEOUT:-560} python3 -m mlaserve.cli tune fused-moe --model-config mlaserve/tools/configs/deepseek-v3.json \
        --dtype fp8_w8a8 --batch-sizes ${TUNE_SIZES:-1024 2048 4096 8192} --out-dir "$OUT/tuned" \
        > "$OUT/tune_v3.txt" 2>"$OUT/tune_v3_err.txt"
      grep -E "^T=|wrote" "$OUT/tune_v3.txt"; tail -3 "$OUT/tune_v3_err.txt" ;;
    tuneab)
      timeout 300 python3 benchmarks/ab_moe_tables.py --model-config mlaserve/tools/configs/deepseek-v3.json \
        --dtype fp8_w8a8 --new "$OUT"/tuned/E=256,N=2048*.json > "$OUT/tuneab.md" 2>&1
      grep -v Warn "$OUT/tuneab.md" | tail -14 ;;
    combine)
      nosum="import mlaserve.kernels.fused_moe as fm; fm.SUM_ROWS_MIN_TOKENS = 1 << 40"
      for model in $V2L $V3_4L; do
        for tag in off on off on; do
          p="import sys"; [ $tag = off ] && p="$nosum"
          timeout 170 python3 -c "$p
import sys; from mlaserve.cli import main; sys.exit(main())" bench one-batch --load-format dummy --model-config $model \
            --batch-size 1 --input-len 4096 --output-len 4 2>&1 | grep "^| mlaserve" | sed "s|^|$(basename $model) $tag |"
        done
      done ;;
    flash)
      timeout 400 python3 benchmarks/sweep_mla_prefill.py --out "$OUT/flash_sweep.txt" > "$OUT/flash_sweep.log" 2>&1
      tail -30 "$OUT/flash_sweep.log" ;;
  esac
done
