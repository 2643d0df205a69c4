#!/usr/bin/env bash
# Issue 5 device runs: tune the kernels and bench them. Parts run in the order given (one call: 10 minutes):
#   bash benchmarks/gpu_tune.sh moe-a   # fused_moe: V2-Lite bf16 and V3 fp8 tp8    -> $OUT/configs/*.json
#   bash benchmarks/gpu_tune.sh moe-b   # fused_moe: V3 fp8 tp1                     -> $OUT/configs/*.json
#   bash benchmarks/gpu_tune.sh moe-tp2 # fused_moe at tp 2's shapes: V3 fp8 (E=256,N=1024), V2-Lite bf16 (E=64,N=704)
#   bash benchmarks/gpu_tune.sh moe-ep2 # fused_moe at ep 2's shape: V3 fp8 (E=128,N=2048; DP attention + EP too)
#   bash benchmarks/gpu_tune.sh moe-tp4 # fused_moe at tp 4's shape: V3 fp8 (E=256,N=512)
#   bash benchmarks/gpu_tune.sh gemm    # fp8_gemm at the six V3 (N, K) shapes      -> $OUT/configs/*.json
#   bash benchmarks/gpu_tune.sh gemm-tp2 # fp8_gemm at the five V3 shapes tp 2 splits -> $OUT/configs/*.json
#   bash benchmarks/gpu_tune.sh gemm-tp4 # fp8_gemm at the V3 shapes tp 4 logged untuned -> $OUT/configs/*.json
#   bash benchmarks/gpu_tune.sh decode  # mla_decode tile / split sweep             -> $OUT/mla_decode_sweep.txt
#   bash benchmarks/gpu_tune.sh prefill # mla_prefill flash tile sweep + profile    -> $OUT/mla_prefill_sweep.txt
#   bash benchmarks/gpu_tune.sh bench   # mlaserve bench kernels with the configs in mlaserve/kernels/configs
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/configs"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/env.txt"
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__)' | tee -a "$OUT/env.txt"
git log -1 --format='commit %h %s' 2>/dev/null | tee -a "$OUT/env.txt"
C=mlaserve/tools/configs
[ $# -gt 0 ] || set -- help
for part in "$@"; do
case "$part" in
  moe-a|moe-b|moe-tp2|moe-ep2|moe-tp4)
    case "$part" in
      moe-a) shapes=("$C/deepseek-v2-lite.json --dtype bf16" "$C/deepseek-v3.json --dtype fp8_w8a8 --tp-size 8") ;;
      moe-b) shapes=("$C/deepseek-v3.json --dtype fp8_w8a8") ;;
      moe-tp2) shapes=("$C/deepseek-v3.json --dtype fp8_w8a8 --tp-size 2" "$C/deepseek-v2-lite.json --dtype bf16 --tp-size 2") ;;
      moe-ep2) shapes=("$C/deepseek-v3.json --dtype fp8_w8a8 --tp-size 2 --ep-size 2") ;;
      moe-tp4) shapes=("$C/deepseek-v3.json --dtype fp8_w8a8 --tp-size 4") ;;
    esac
    for args in "${shapes[@]}"; do
      timeout 290 python3 -m mlaserve.cli tune fused-moe --model-config $args --out-dir "$OUT/configs" \
        2>>"$OUT/tune_moe_err.txt" | tee -a "$OUT/tune_moe.txt"
    done ;;
  gemm)
    timeout 560 python3 -m mlaserve.cli tune fp8-gemm --out-dir "$OUT/configs" 2>"$OUT/tune_gemm_err.txt" \
      | tee "$OUT/tune_gemm.txt" | grep -E "M=(1|16|4096):|wrote" ;;
  gemm-tp2)   # the V3 shapes that tp 2 splits (q_b, kv_b, o_proj, dense gate_up / down), untuned on H200 so far
    timeout 560 python3 -m mlaserve.cli tune fp8-gemm --shapes 12288,1536 16384,512 7168,8192 18432,7168 7168,9216 \
      --out-dir "$OUT/configs" 2>"$OUT/tune_gemm_err.txt" | tee "$OUT/tune_gemm.txt" | grep -E "M=(1|16|4096):|wrote" ;;
  gemm-tp4)   # q_b, o_proj, dense gate_up / down at tp 4 (v3-scale-h200x4.md: the four the ranks logged untuned)
    timeout 560 python3 -m mlaserve.cli tune fp8-gemm --shapes 6144,1536 7168,4096 9216,7168 7168,4608 \
      --out-dir "$OUT/configs" 2>"$OUT/tune_gemm_err.txt" | tee "$OUT/tune_gemm.txt" | grep -E "M=(1|16|4096):|wrote" ;;
  decode)
    timeout 560 python3 benchmarks/sweep_mla_decode.py --out "$OUT/mla_decode_sweep.txt" 2>&1 | tail -60 ;;
  prefill)
    timeout 300 python3 benchmarks/sweep_mla_prefill.py --out "$OUT/mla_prefill_sweep.txt" 2>&1 | tail -25 ;;
  check)      # GPU tests (kernels, fast path) and one-batch V2-Lite decode with the shipped tables
    [ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site:$PWD timeout 280 python3 -m pytest -q -p no:cacheprovider -rA tests/kernels \
      tests/models/test_gpu_fastpath.py 2>&1 | grep -E "^(PASSED|FAILED|ERROR)|passed|failed" \
      | tee "$OUT/gpu_tests.txt" | tail -3
    PYTHONPATH=/tmp/site:$PWD timeout 150 python3 -m mlaserve.cli bench one-batch --load-format dummy \
      --model-config $C/deepseek-v2-lite.json --batch-size 1 16 64 --input-len 256 --output-len 32 \
      --output-file "$OUT/one_batch.md" 2>&1 | grep "^|" | tail -4 ;;
  profile-moe)
    timeout 200 python3 benchmarks/profile_moe.py 2>&1 | tee "$OUT/profile_moe.txt" | tail -40 ;;
  bench)
    timeout 560 python3 -m mlaserve.cli bench kernels --output "$OUT/kernels.md" > "$OUT/kernels_log.txt" 2>&1
    grep -E "^\|" "$OUT/kernels.md" | cut -c1-160 ;;
  *) echo "usage: $0 moe-a|moe-b|moe-tp2|moe-ep2|moe-tp4|gemm|gemm-tp2|gemm-tp4|decode|prefill|check|profile-moe|bench ..."; exit 2 ;;
esac
# later parts (bench) use the fresh tables; TABLES_INTO_TREE=0 when another job shares this tree (gpu_jobs.sh)
[ "${TABLES_INTO_TREE:-1}" = 1 ] && cp "$OUT"/configs/*.json mlaserve/kernels/configs/ 2>/dev/null
done
tar -C "$OUT" -cf "$OUT/configs.tar" configs     # the file names hold spaces and brackets: carried as one tar
