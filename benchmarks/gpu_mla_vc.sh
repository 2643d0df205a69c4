#!/usr/bin/env bash
# Issue 15: the absorbed decode's W_UV GEMM merged into the MLA decode's split reduce (`_mla_reduce_vc_kernel`: one
# launch a layer fewer) on one GPU (carry .whl and .old: a `git archive` of the tree before it, without mlaserve/demo
# and benchmarks/results).
#   tests: the MLA decode / absorb / backend kernel tests and the fast path's greedy equality on the GPU
#   ab:    bench one-batch V2-Lite at bs 1 / 16 / 64 and V3 4 layers FP8 at bs 1 / 64, the old tree and this one
#          alternated twice
#   bash benchmarks/gpu_mla_vc.sh [tests|ab|all]...
source benchmarks/gpu_v2l_env.sh
cat "$OUT/env.txt"
python3 benchmarks/v3_config.py --layers 4 --out /tmp/v3_4.json > /dev/null
ob() {  # ob TAG TREE CONFIG BATCH_SIZES...: one-batch from the source tree TREE
  local tag=$1 tree=$2 cfg=$3; shift 3
  echo "### $tag"
  (cd "$tree" && PYTHONPATH=$PWD:/tmp/site timeout 200 python3 -m mlaserve.cli bench one-batch --load-format dummy \
    --input-len 256 --output-len 32 --model-config "$cfg" --batch-size "$@" --output-file "$OUT/one_batch_$tag.md" \
    2>&1 | grep "^|" | tail -3)
}
for PART in "${@:-all}"; do
  if [ "$PART" = tests ] || [ "$PART" = all ]; then
    timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/kernels/test_mla_decode.py \
      tests/kernels/test_mla_absorb.py tests/attention/test_triton_backend.py 2>&1 | tail -4 | tee "$OUT/tests_mla.txt"
    timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/models/test_gpu_fastpath.py 2>&1 | tail -3 \
      | tee "$OUT/tests_fastpath.txt"
  fi
  if [ "$PART" = ab ] || [ "$PART" = all ]; then
    for i in 1 2; do
      ob v2l_old$i .old "$PWD/$V2L" 1 16 64
      ob v2l_new$i . "$PWD/$V2L" 1 16 64
    done
    ob v3_old .old /tmp/v3_4.json 1 64
    ob v3_new . /tmp/v3_4.json 1 64
  fi
done
