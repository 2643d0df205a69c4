#!/usr/bin/env bash
# Issue 15, decode launches folded together (the post-attention norm into the router, no align launch for one-token
# MoE, no reduce launch for one-split MLA decode). Two device calls on an H100 (carry .whl and .old, the tree
# before: `mkdir .old && git archive REV mlaserve benchmarks pyproject.toml | tar -x -C .old`, without the demo
# weights):
#   bash benchmarks/gpu_fold.sh check   GPU tests of the changed kernels and the fast path, bench_decode_fold.py,
#                                       the bs-1 decode profiles (kernels per step), old and new
#   bash benchmarks/gpu_fold.sh bench   one-batch V2-Lite bs 1 / 16 / 64, old then new, twice; V3 4L once each
set -uo pipefail
[ -d .whl ] && python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONUNBUFFERED=1 MLASERVE_CACHE=/tmp/mlaserve-cache
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PART=${1:-check}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/env.txt"
python3 -c "import json; d=json.load(open('mlaserve/tools/configs/deepseek-v3.json')); d['num_hidden_layers']=4; json.dump(d, open('/tmp/v3_4l.json','w'))"
[ -d .old ] && { rm -rf /tmp/old && cp -r .old /tmp/old; }
new() { PYTHONPATH=$PWD:/tmp/site "$@"; }
old() { (cd /tmp/old && PYTHONPATH=/tmp/old:/tmp/site "$@"); }
if [ "$PART" = check ]; then
  new timeout 420 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gemv.py tests/kernels/test_moe_topk.py \
    tests/kernels/test_mla_decode.py tests/kernels/test_fused_moe.py tests/attention tests/models/test_gpu_fastpath.py \
    2>&1 | tail -12 | tee "$OUT/tests.txt"
  new timeout 120 python3 benchmarks/bench_decode_fold.py 2>&1 | grep -v Warn | tee "$OUT/fold.jsonl"
  for code in old new; do
    $code timeout 90 python3 benchmarks/profile_decode.py --bs 1 > "$OUT/prof_v2l_bs1_$code.txt" 2>&1
    grep -A22 "kernels per step" "$OUT/prof_v2l_bs1_$code.txt"
  done
  new timeout 90 python3 benchmarks/profile_decode.py --bs 1 --model-config /tmp/v3_4l.json > "$OUT/prof_v3_bs1_new.txt" 2>&1
  grep -A3 "kernels per step" "$OUT/prof_v3_bs1_new.txt"
fi
if [ "$PART" = route ] || [ "$PART" = rope ] || [ "$PART" = next ]; then
  # the one-tile router; W_UK's GEMM in the rope's launch; the next layer's input norm in the MoE combine
  K="route or greedy_equals"; [ "$PART" = rope ] && K="rope or absorb or greedy_equals or logprobs"
  [ "$PART" = next ] && K="fused_moe or greedy_equals or logprobs or spec"
  new timeout 400 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_moe_topk.py tests/kernels/test_mla_absorb.py \
    tests/kernels/test_rope.py tests/kernels/test_fused_moe.py tests/models/test_gpu_fastpath.py tests/engine/test_spec.py \
    -k "$K" 2>&1 | tail -3 | tee "$OUT/tests.txt"
  [ "$PART" = route ] && new timeout 120 python3 benchmarks/bench_decode_fold.py --tokens 1 16 2>&1 | grep -v Warn | tee "$OUT/fold.jsonl"
  new timeout 90 python3 benchmarks/profile_decode.py --bs 1 > "$OUT/prof_v2l_bs1_new.txt" 2>&1
  grep -A12 "kernels per step" "$OUT/prof_v2l_bs1_new.txt"
  B="python3 -m mlaserve.cli bench one-batch --load-format dummy --input-len 256 --output-len 32"
  for code in old new; do
    echo "### $code"
    $code timeout 120 $B --model-config mlaserve/tools/configs/deepseek-v2-lite.json --batch-size 1 16 64 \
      --output-file "$OUT/one_batch_$code.md" 2>&1 | grep "^|" | tail -3
  done
fi
if [ "$PART" = bench ]; then
  B="python3 -m mlaserve.cli bench one-batch --load-format dummy --input-len 256 --output-len 32"
  for round in 1 2; do
    for code in old new; do
      echo "### $code, round $round"
      $code timeout 120 $B --model-config mlaserve/tools/configs/deepseek-v2-lite.json --batch-size 1 16 64 \
        --output-file "$OUT/one_batch_$code.md" 2>&1 | grep "^|" | tail -3
    done
  done
  for code in old new; do
    echo "### $code, V3 4L"
    $code timeout 120 $B --model-config /tmp/v3_4l.json --batch-size 1 16 64 --output-file "$OUT/one_batch_$code.md" \
      2>&1 | grep "^|" | tail -3
  done
fi
