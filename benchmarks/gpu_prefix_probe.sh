#!/usr/bin/env bash
# A lone request's time to first token in the scheduler (V2-Lite, dummy weights, piecewise graphs), without and with a
# one-token radix hit (`probe_first_token.py --shared-first`), the latter profiled; then the fast-path GPU tests.
# Carry .whl.
source benchmarks/gpu_v2l_env.sh
timeout 150 python3 benchmarks/probe_first_token.py --model-path $M --piecewise > "$OUT/probe_plain.txt" 2>&1
tail -1 "$OUT/probe_plain.txt"
timeout 150 python3 benchmarks/probe_first_token.py --model-path $M --piecewise --shared-first --profile \
  > "$OUT/probe_shared.txt" 2>&1
tail -1 "$OUT/probe_shared.txt"; grep -A18 "Self CPU %" "$OUT/probe_shared.txt" | cut -c1-60,100-210
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/models/test_gpu_fastpath.py 2>&1 | tail -2 | tee "$OUT/tests.txt"
