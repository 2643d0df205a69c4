#!/usr/bin/env bash
# Issue 17 on two GPUs (nvidia-h200-x2): the seeds' two ablation tables, every row (tp 2: EP 2, DP attention 2),
# DeepSeek-V3 full width, $V3_LAYERS layers (default 10: fits an H100's 80 GB at tp 2 with room for the KV pool)
# + its MTP layer, block FP8, dummy weights, our tokenizer. One server a row for both tables.
# A row takes ~1-2 min (startup 25-85 s, torch.compile rows longer, single query ~20 s, offline at 256 ~45 s):
# split the rows over device calls, four torch.compile rows in each half:
#   ROWS="0 1 2 3 9 10 11 12" bash benchmarks/gpu_ablation_2gpu.sh     then ROWS="4 5 6 7 8 13 14 15"
# $SERVE_EXTRA: more `mlaserve serve` flags for every row (e.g. "--cuda-graph-max-bs 256"). $TABLES: "offline" for
# the offline table only (default both); KEEP_LOGS=1 keeps each row's server log (info) as $OUT/rowN.log.
# Offline levels: $CONCURRENCY (default "256"), $PER_LEVEL (default 1) x concurrency requests each, the seeds'
# 760 in / 460 out. Results: $OUT/ablation.md and $OUT/points.json (rewritten after every row), $OUT/ablation.png
# (with matplotlib; without it, chart the halves' points here: ablation.py --plot-from A.json B.json --plot X.png).
set -uo pipefail
[ -d .whl ] && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site MLASERVE_CACHE=${MLASERVE_CACHE:-/tmp/mlaserve-cache}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1   # never NVLink multicast
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
M=/tmp/v3_abl_${PORT:-0}; mkdir -p $M          # one model folder per job (gpu_jobs.sh gives each its own $PORT)
python3 benchmarks/v3_config.py --layers ${V3_LAYERS:-10} --out $M/config.json
python3 -m mlaserve.tools.tokenizer $M > /dev/null
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/env.txt" 2>&1
PLOT=""; python3 -c "import matplotlib" 2> /dev/null && PLOT="--plot $OUT/ablation.png"   # the image may lack it
timeout ${LIMIT:-560} python3 benchmarks/ablation.py --model-path $M --tp 2 --rows ${ROWS:-0 1 2 3 9 10 11 12} \
  --concurrency ${CONCURRENCY:-256} --prompts-per-level ${PER_LEVEL:-1} --start-timeout 300 --table ${TABLES:-single offline} \
  --port ${PORT:-30123} \
  $([ -n "${KEEP_LOGS:-}" ] && echo --server-logs "$OUT") \
  --serve-args "--load-format dummy ${SERVE_EXTRA:-}" --out "$OUT/ablation.md" --points "$OUT/points.json" $PLOT 2>&1 \
  | grep -v "Warn\|warn" | tail -40
