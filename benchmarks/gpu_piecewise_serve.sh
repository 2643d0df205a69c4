#!/usr/bin/env bash
# Serving with piecewise prefill graphs: `mlaserve serve` V2-Lite (full width, dummy weights) plain, with
# --enable-piecewise-cuda-graph, and with it plus --enable-mixed-chunk; `bench serving --backend mlaserve`, prompts
# of 128-256 tokens (--random-range-ratio 0.5: lengths vary as in real traffic) at concurrency 1 (24 prompts, 16 new
# tokens: TTFT) and 64 (192 prompts, 128 new tokens: TPOT, ITL per token). Carry .whl. `reverse`: piecewise first,
# then plain (the first server on a fresh machine compiles the Triton kernels the later ones find cached). `mixed`:
# piecewise, then piecewise + mixed chunk. `chunk`: the same two with --chunked-prefill-size 512.
source benchmarks/gpu_v2l_env.sh
i=0
CONFIGS=("" "--enable-piecewise-cuda-graph" "--enable-piecewise-cuda-graph --enable-mixed-chunk")
[ "${1:-}" = reverse ] && CONFIGS=("--enable-piecewise-cuda-graph" "")    # the other order (Triton cache cold first)
[ "${1:-}" = mixed ] && CONFIGS=("--enable-piecewise-cuda-graph" "--enable-piecewise-cuda-graph --enable-mixed-chunk")
[ "${1:-}" = chunk ] && CONFIGS=("--enable-piecewise-cuda-graph --chunked-prefill-size 512"
  "--enable-piecewise-cuda-graph --enable-mixed-chunk --chunked-prefill-size 512")
for flags in "${CONFIGS[@]}"; do
  i=$((i + 1)); name=${flags:-plain}; name=${name//--enable-/}; name=${name//--/}; name=${name// /+}
  t0=$(date +%s.%N)
  SERVE_TAG=$i serve_and_wait --log-level info $flags
  echo "### $name: first served token $(python3 -c "import time; print(round(time.time() - $t0, 1))") s after launch"
  for spec in "1 24 16" "64 192 128"; do
    set -- $spec
    timeout 170 python3 -m mlaserve.cli bench serving --backend mlaserve --num-prompts $2 \
      --random-input-len 256 --random-output-len $3 --random-range-ratio 0.5 --request-rate inf --max-concurrency $1 \
      --tokenizer $M --disable-tqdm --output-file "$OUT/serving_$i.jsonl" > /dev/null 2>&1
    python3 benchmarks/serving_summary.py --last "$OUT/serving_$i.jsonl" "$name"
  done
  curl -s http://127.0.0.1:30000/metrics | grep -E "^mlaserve[:_](piecewise_graph_steps|mixed_steps)" | head -4
  pkill -TERM -f "mlaserve.cli serve"; sleep 4
done
grep -h "captured piecewise" "$OUT"/serve_*.log | cut -c1-200
