#!/usr/bin/env bash
# One device call after merging the decode kernels, mixed chunks and tree drafts: one-batch V2-Lite and V3 4-layer
# FP8 (the issue-15 table), tree drafts on the GPU (benchmarks/gpu_tree.sh), then the bs-1 decode profile with its
# host ops. Usage (repo root, carry .whl): bash benchmarks/gpu_final_a.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
bash benchmarks/gpu_decode_perf.sh bench 2>&1 | grep "^|" | tail -8
bash benchmarks/gpu_tree.sh 2>&1 | grep -v "Warn\|warn\|Target directory" | tail -45
export PYTHONPATH=$PWD:/tmp/site
timeout 90 python3 benchmarks/profile_decode.py --bs 1 2>&1 | grep -v "loading\|Warn\|warn" > "$OUT/prof_v2l_bs1.txt"
head -24 "$OUT/prof_v2l_bs1.txt"; grep -A30 "whole decode step" "$OUT/prof_v2l_bs1.txt"
