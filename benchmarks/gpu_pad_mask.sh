#!/usr/bin/env bash
# Padded decode graphs route their padding rows to no expert (mlaserve/engine/graph.py): A/B on one GPU, the same
# machine, MLASERVE_PAD_MASK=0 (every padded row routes, as before) then 1 (the default). Batch sizes between the
# graph sizes (3 -> 4, 12 -> 16, 20 -> 24, 44 -> 48) and two exact sizes (16, 48: no padding, the mask's own cost).
#   bash benchmarks/gpu_pad_mask.sh          V2-Lite bf16 and V3 4 layers FP8, input 256, output 32 (~5 min)
#   bash benchmarks/gpu_pad_mask.sh tests    the GPU tests of the changed paths first (~3 min)
set -uo pipefail
[ -d .whl ] && python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONUNBUFFERED=1 MLASERVE_CACHE=/tmp/mlaserve-cache PYTHONPATH=$PWD:/tmp/site
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/env.txt"
if [ "${1:-}" = tests ]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_moe_topk.py tests/layers/test_moe.py \
    tests/engine/test_padded_rows.py tests/models/test_gpu_fastpath.py -k "mask or pad or compile" 2>&1 | tail -5 \
    | tee "$OUT/tests.txt"
fi
python3 benchmarks/v3_config.py --layers 4 --out /tmp/v3_4l_pad.json
B="python3 -m mlaserve.cli bench one-batch --load-format dummy --input-len 256 --output-len 32"
for cfg in mlaserve/tools/configs/deepseek-v2-lite.json /tmp/v3_4l_pad.json; do
  tag=$(basename $cfg .json)
  for m in 0 1; do
    echo "### $tag MLASERVE_PAD_MASK=$m"
    MLASERVE_PAD_MASK=$m timeout 170 $B --model-config $cfg --batch-size 3 12 16 20 44 48 \
      --output-file "$OUT/one_batch_${tag}_mask$m.md" 2>&1 | grep "^|" | tail -6
  done
done
