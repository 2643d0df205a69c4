#!/usr/bin/env bash
# Issue 15 (decode at the memory floor): GPU tests of the changed kernels and the fast path, the decode profile
# (kernels per step), then one-batch V2-Lite and V3 4-layer FP8 as in benchmarks/results/one-batch-h100.md.
# Usage (repo root, on the GPU machine, carry .whl): bash benchmarks/gpu_decode_perf.sh [tests|prof|bench|all]
set -uo pipefail
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>/dev/null
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site MLASERVE_CACHE=/tmp/mlaserve-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PART=${1:-all}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/env.txt"
python3 -c "import json; d=json.load(open('mlaserve/tools/configs/deepseek-v3.json')); d['num_hidden_layers']=4; json.dump(d, open('/tmp/v3_4l.json','w'))"
if [ "$PART" = all ] || [ "$PART" = tests ]; then
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_mla_decode.py tests/kernels/test_mla_absorb.py \
    tests/kernels/test_rope.py ${EXTRA_TESTS:-} tests/models/test_gpu_fastpath.py 2>&1 | tail -8 | tee "$OUT/tests.txt"
fi
if [ "$PART" = all ] || [ "$PART" = prof ]; then
  python3 benchmarks/profile_decode.py --bs 1 > $OUT/prof_v2l_bs1.txt 2>&1; grep -A40 "kernels per step" $OUT/prof_v2l_bs1.txt | head -40
  python3 benchmarks/profile_decode.py --bs 1 --model-config /tmp/v3_4l.json > $OUT/prof_v3_bs1.txt 2>&1
  grep -A25 "kernels per step" $OUT/prof_v3_bs1.txt
fi
if [ "$PART" = all ] || [ "$PART" = bench ]; then
  B="python3 -m mlaserve.cli bench one-batch --load-format dummy"
  timeout 150 $B --model-config mlaserve/tools/configs/deepseek-v2-lite.json --batch-size 1 16 64 --input-len 256 \
    --output-len 32 --output-file "$OUT/one_batch.md" 2>&1 | grep "^|" | tail -4
  timeout 200 $B --model-config /tmp/v3_4l.json --batch-size 1 16 64 --input-len 256 --output-len 32 \
    --output-file "$OUT/one_batch.md" 2>&1 | grep "^|" | tail -4
fi
if [ "$PART" = all ] || [ "$PART" = prefill ]; then
  python3 benchmarks/profile_prefill.py --len 4096 2>&1 | grep -v "loading\|Warn\|warn" | tee $OUT/prof_prefill_v2l.txt | head -30
  python3 benchmarks/profile_prefill.py --len 4096 --model-config /tmp/v3_4l.json 2>&1 | grep -v "loading\|Warn\|warn\|no tuned" | tee $OUT/prof_prefill_v3.txt | head -30
fi
if [ "$PART" = tune ]; then   # the dense MLP shapes of V3 / R1 (first_k_dense_replace layers), TP 1
  timeout 500 python3 -m mlaserve.tools.tune_fp8_gemm --shapes 36864,7168 7168,18432 --batch-sizes ${TUNE_BS:-1 16 64 256 1024 4096} \
    --out-dir $OUT/configs 2>&1 | grep -v Warn | tail -20
fi
