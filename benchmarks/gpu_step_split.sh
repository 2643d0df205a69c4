#!/usr/bin/env bash
# Issue 15: the synchronous decode step's parts beside its graph (benchmarks/probe_step_split.py) on V2-Lite and
# V3 4L, and the per-kernel profile of the V2-Lite bs 16 step (PDL off). Carry .whl.
#   bash benchmarks/gpu_step_split.sh [split|profile|mla|onebatch|check|repeat|all]
source benchmarks/gpu_v2l_env.sh
PART=${1:-all}
cat "$OUT/env.txt"
if [ "$PART" = split ] || [ "$PART" = all ]; then
  timeout 200 python3 benchmarks/probe_step_split.py --model-config $V2L --bs 1 16 64 > "$OUT/split_v2l.txt" 2>&1
  grep -v "^$" "$OUT/split_v2l.txt" | grep -v "loading weights" | head -40
  timeout 150 python3 benchmarks/probe_step_split.py --model-config $V3_4L --bs 1 64 > "$OUT/split_v3.txt" 2>&1
  grep -v "^$" "$OUT/split_v3.txt" | grep -v "loading weights" | head -12
fi
if [ "$PART" = profile ] || [ "$PART" = all ]; then
  MLASERVE_PDL=0 timeout 150 python3 benchmarks/profile_decode.py --model-config $V2L --bs 16 > "$OUT/dec_v2l_bs16.txt" 2>&1
  grep -A25 "kernels per step" "$OUT/dec_v2l_bs16.txt" | head -28 | cut -c1-140
fi
if [ "$PART" = mla ] || [ "$PART" = all ]; then
  timeout 300 python3 benchmarks/sweep_mla_batch.py --out "$OUT/sweep_mla_batch.txt" > "$OUT/sweep_mla_batch.log" 2>&1
  grep "now\|best" "$OUT/sweep_mla_batch.log"
fi
if [ "$PART" = onebatch ] || [ "$PART" = all ]; then
  for cfg in "v2l $V2L" "v3 $V3_4L"; do
    set -- $cfg
    timeout 200 python3 -m mlaserve.cli bench one-batch --load-format dummy --model-config $2 --input-len 256 \
      --output-len 32 --batch-size 1 16 64 --output-file "$OUT/one_batch_$1.md" 2>&1 | grep "^|" | tail -4
  done
fi
if [ "$PART" = check ]; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_mla_decode.py tests/models/test_gpu_fastpath.py \
    tests/scheduler/test_cached_prompt.py 2>&1 | tail -3 | tee "$OUT/tests_decode.txt"
  timeout 330 python3 -m pytest -q -p no:cacheprovider tests/test_combinations.py -k "gpu and not multi_gpu" 2>&1 \
    | tail -4 | tee "$OUT/tests_combinations.txt"
fi
if [ "$PART" = repeat ]; then             # one-batch V2-Lite three times (the spread between runs), V3 4L once
  for i in 1 2 3; do
    timeout 150 python3 -m mlaserve.cli bench one-batch --load-format dummy --model-config $V2L --input-len 256 \
      --output-len 32 --batch-size 1 16 64 --output-file "$OUT/one_batch_v2l_$i.md" 2>&1 | grep "^| mlaserve" | tail -3
  done
  timeout 150 python3 -m mlaserve.cli bench one-batch --load-format dummy --model-config $V3_4L --input-len 256 \
    --output-len 32 --batch-size 1 16 64 --output-file "$OUT/one_batch_v3.md" 2>&1 | grep "^| mlaserve" | tail -3
fi
if [ "$PART" = abmla ]; then             # MLA decode's 16-row tiles on 4 warps (old) and 8 (new), twice each, one call
  OLD="import mlaserve.kernels.mla_decode as d; d.CONFIGS[16] = d.CONFIGS[16]._replace(num_warps=4)"
  for tag in old1 new1 old2 new2; do
    patch=pass; [ "${tag#old}" != "$tag" ] && patch=$OLD
    echo "### $tag"
    timeout 120 python3 -c "import sys; $patch; from mlaserve.cli import main; sys.exit(main())" bench one-batch \
      --load-format dummy --input-len 256 --output-len 32 --model-config $V2L --batch-size 1 16 64 \
      --output-file "$OUT/one_batch_mla_$tag.md" 2>&1 | grep "^| mlaserve" | cut -d'|' -f3,9,10,12,13,14
  done
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_mla_decode.py tests/models/test_gpu_fastpath.py \
    2>&1 | tail -3 | tee "$OUT/tests_decode.txt"
fi
if [ "$PART" = align ]; then             # MoE align in two launches (count + scan-and-scatter) against three
  timeout 100 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fused_moe.py -k align 2>&1 | tail -2 \
    | tee "$OUT/tests_align.txt"
  timeout 150 python3 benchmarks/bench_moe_align.py > "$OUT/moe_align.txt" 2>&1; grep -v "^{" "$OUT/moe_align.txt" | tail -24
  OLD="import mlaserve.kernels.fused_moe as m; m.ALIGN_TWO_LAUNCH_MAX_READS = 0; m.ALIGN_ONE_PROGRAM_MAX_WORK = 288 * 128"
  for run in "old1 $V2L" "new1 $V2L" "old2 $V2L" "new2 $V2L" "old1 $V3_4L" "new1 $V3_4L"; do
    set -- $run
    patch=pass; [ "${1#old}" != "$1" ] && patch=$OLD
    tag=$1_$(basename $2 .json)
    echo "### $tag"
    timeout 100 python3 -c "import sys; $patch; from mlaserve.cli import main; sys.exit(main())" bench one-batch \
      --load-format dummy --input-len 256 --output-len 32 --model-config $2 --batch-size 64 \
      --output-file "$OUT/one_batch_align_$tag.md" 2>&1 | grep "^| mlaserve" | cut -d'|' -f3,9,10,12,13,14,16
  done
fi
