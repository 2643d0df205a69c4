#!/usr/bin/env bash
# Session of 2026-12-06, one H100 (`nvidia-h100-x1`; carry .whl: ../shared/device/wheels.sh). Issue 15's targets on
# the GPU the issue names, at the current tree, in one call:
#   table:   bench one-batch V2-Lite (full config, dummy) bs 1 16 64, in 256 / out 32
#   serve:   mlaserve serve (piecewise graphs + mixed chunk + metrics) under bench serving, fixed 256 in / 128 out,
#            concurrency 1 (12 prompts), 16 (64), 64 (192), each level fresh prompts (its own seed), after a warm-up
#            of the load's shapes; compare TPOT with `table`'s steps, TTFT at conc 1 with its bs-1 prefill
#   v3:      bench one-batch V3 full width cut to 4 layers, FP8, bs 1 16 64, in 256 / out 32
#   prefill: bench one-batch bs 1, in 4096 / out 4: V2-Lite, then V3 4L
#   bash benchmarks/gpu_session53.sh PART...
source benchmarks/gpu_v2l_env.sh
cat "$OUT/env.txt"
B="python3 -m mlaserve.cli bench one-batch --load-format dummy"
for PART in "$@"; do
  echo "=== $PART $(date +%T)"
  case $PART in
    table)
      timeout 150 $B --model-config $V2L --batch-size 1 16 64 --input-len 256 --output-len 32 \
        --output-file "$OUT/one_batch.md" > "$OUT/table.log" 2>&1
      grep -a "^| mlaserve" "$OUT/table.log" || tail -3 "$OUT/table.log" ;;
    serve)
      SERVE_TAG=mixed serve_and_wait --log-level warning --enable-piecewise-cuda-graph --enable-metrics --enable-mixed-chunk \
        || { echo "server did not start"; tail -5 "$OUT/serve_mixed.log"; continue; }
      python3 benchmarks/probe_stream_client.py --num 64 --conc 64 > /dev/null     # warm-up: the load's shapes
      for lv in "1 12 11" "16 64 12" "64 192 13"; do
        set -- $lv
        timeout 120 python3 -m mlaserve.cli bench serving --backend mlaserve --num-prompts $2 --seed $3 \
          --random-input-len 256 --random-output-len 128 --random-range-ratio 1.0 --request-rate inf \
          --max-concurrency $1 --tokenizer $M --disable-tqdm --output-file "$OUT/serving_c$1.jsonl" > /dev/null 2>&1
        python3 benchmarks/serving_summary.py --last "$OUT/serving_c$1.jsonl" "serve" 2>&1 | tail -1
      done
      pkill -TERM -f "mlaserve.cli serve"; sleep 4 ;;
    v3)
      timeout 200 $B --model-config $V3_4L --batch-size 1 16 64 --input-len 256 --output-len 32 \
        --output-file "$OUT/one_batch.md" > "$OUT/v3.log" 2>&1
      grep -a "^| mlaserve" "$OUT/v3.log" || tail -3 "$OUT/v3.log" ;;
    prefill)
      for m in $V2L $V3_4L; do
        timeout 150 $B --model-config $m --batch-size 1 --input-len 4096 --output-len 4 \
          --output-file "$OUT/one_batch.md" > "$OUT/prefill.log" 2>&1
        grep -a "^| mlaserve" "$OUT/prefill.log" || tail -3 "$OUT/prefill.log"
      done ;;
    *) echo "unknown part $PART" ;;
  esac
done
echo "=== done $(date +%T)"
