#!/usr/bin/env bash
# Issue 18: DeepSeek-V3 (its config, block FP8, dummy weights) over $GPUS GPUs: 8 and the whole model (V3_LAYERS=61)
# on nvidia-h200-x8; the same script on nvidia-h200-x2 with GPUS=2 and the layers that fit (default 12).
#   bash benchmarks/gpu_v3_scale.sh one-batch   `bench one-batch` tp N, in 256 / out 32, bs 1 16 64: CUDA graphs, torch.compile
#                                               + graphs, and EAGLE (3, 1, 4) with graphs (its step against the plain
#                                               one: random weights give no real acceptance)
#   bash benchmarks/gpu_v3_scale.sh serve A ..  gpu_dp_ep.sh serve (tp tp-ep dp dp-ep dp-ep-a2a) at CONCURRENCY (16 256 768)
# Results under $OUT (one_batch.md, spec_projection.md; serving_*.jsonl, capacity.txt with startup times). Carry .whl.
# CPU dry run: DRY_CPU=1 V3_LAYERS=2 bash benchmarks/gpu_v3_scale.sh one-batch. RUNS_ONLY=plain: the CUDA-graph run alone.
set -uo pipefail
[ -d .whl ] && python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site MLASERVE_CACHE=${MLASERVE_CACHE:-/tmp/mlaserve-cache}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1   # never NVLink multicast
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
PART=${1:-one-batch}; shift || true
N=${GPUS:-2}
if [ "$PART" = serve ]; then
  CONCURRENCY=${CONCURRENCY:-16 256 768} exec bash benchmarks/gpu_dp_ep.sh serve "$@"
fi
CFG=/tmp/v3_scale/config.json
if [ -n "${DRY_CPU:-}" ]; then
  python3 benchmarks/v3_config.py --layers ${V3_LAYERS:-2} --tiny --out $CFG
  RUNS=("--device cpu --disable-cuda-graph" "--device cpu --disable-cuda-graph --speculative-algorithm EAGLE")
  BS="1 2"
else
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/env.txt" 2>&1
  python3 benchmarks/v3_config.py --layers ${V3_LAYERS:-12} --out $CFG
  RUNS=("" "--enable-torch-compile" "--speculative-algorithm EAGLE")
  [ "${RUNS_ONLY:-}" = plain ] && RUNS=("")          # the CUDA-graph run alone (no projection then)
  BS="1 16 64"
fi
# each run's whole output kept, and every rank's stacks printed each 60 s (the seventh session's call D lost two runs
# to its time limit without a line of why)
export MLASERVE_DUMP_STACKS_EVERY=${MLASERVE_DUMP_STACKS_EVERY:-60}
i=0
for flags in "${RUNS[@]}"; do
  i=$((i + 1))
  echo "## tp $N ${flags:-(CUDA graphs)}" | tee -a "$OUT/one_batch.md"
  timeout ${LIMIT:-400} python3 -m mlaserve.cli bench one-batch --load-format dummy --model-config $CFG \
    --batch-size $BS --input-len 256 --output-len 32 --tp-size $N $flags --output-file "$OUT/one_batch.md" \
    > "$OUT/one_batch_run$i.log" 2>&1
  echo "exit code $? (124: past LIMIT=${LIMIT:-400} s)"; grep "^|\|rror" "$OUT/one_batch_run$i.log" | tail -8
done
# the speculative step's cost against the plain one, and the speedups it would give (projections: the demo model's
# accept length at (3, 1, 4) on the H100, spec-h100.md, and DeepSeek's published 85-90% second-token acceptance)
[ "${RUNS_ONLY:-}" = plain ] && exit 0
python3 benchmarks/spec_projection.py "$OUT/one_batch.md" --accept "demo model (3, 1, 4), H100=3.2" \
  --acceptance 0.85 0.9 | tee "$OUT/spec_projection.md"
