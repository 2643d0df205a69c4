#!/usr/bin/env bash
# Session of 2026-12-06 (second), one H100 (`nvidia-h100-x1`; carry .whl: ../shared/device/wheels.sh). Where the
# decode step's time goes at the current tree, and what one kernel boundary costs:
#   chain:    benchmarks/probe_kernel_chain.py (252 small kernels a graph, PDL off / on, weights before / after the wait)
#   profile:  benchmarks/profile_decode.py V2-Lite bs 1 (MLASERVE_PDL=0 and 1), bs 64 (PDL 0), V3 4L bs 1 (PDL 0)
#   prefill:  benchmarks/profile_prefill.py V3 4L, 1 x 4096
#   moechain: benchmarks/sweep_moe_decode_chain.py (V2-Lite's 26 MoE layers at one token back to back in a graph: the
#             fused MoE's tiles swept there; a PICK line in $OUT/picks.txt where one beats the shipped entry by 3%)
#   moeab:    with a PICK line: bench one-batch V2-Lite bs 1 with the shipped tables and with the pick, alternated twice
#   bash benchmarks/gpu_session55.sh PART...
source benchmarks/gpu_v2l_env.sh
cat "$OUT/env.txt"
for PART in "$@"; do
  echo "=== $PART $(date +%T)"
  case $PART in
    chain)
      timeout 240 python3 benchmarks/probe_kernel_chain.py > "$OUT/chain.md" 2>&1; cat "$OUT/chain.md" ;;
    profile)
      for run in "0 $V2L 1" "1 $V2L 1" "0 $V2L 64" "0 $V3_4L 1"; do
        set -- $run
        f="$OUT/prof_$(basename $2 .json)_bs$3_pdl$1.txt"
        MLASERVE_PDL=$1 timeout 200 python3 benchmarks/profile_decode.py --model-config $2 --bs $3 > "$f" 2>&1
        echo "--- PDL $1 $(basename $2) bs $3"; grep -a -A 14 "kernels per step" "$f" | cut -c1-150 || tail -3 "$f"
      done ;;
    prefill)
      f="$OUT/prof_prefill_v3_4l.txt"
      timeout 200 python3 benchmarks/profile_prefill.py --model-config $V3_4L --len 4096 > "$f" 2>&1
      grep -a -B2 -A 24 "kernel" "$f" | head -45 | cut -c1-160 ;;
    moechain)
      timeout 420 python3 benchmarks/sweep_moe_decode_chain.py --picks "$OUT/picks.txt" > "$OUT/moechain.md" 2>&1
      grep -a -v "^| gate/up\|^| down" "$OUT/moechain.md" | tail -8
      sort -t'|' -k3 -n <(grep -a "^| gate/up\|^| down" "$OUT/moechain.md") | head -6 ;;
    moeab)
      [ -s "$OUT/picks.txt" ] || { echo "no pick: nothing to A/B"; continue; }
      for tag in shipped pick shipped pick; do
        P=""; [ $tag = pick ] && P="fm.CONFIG_DIR = picked_tables('$OUT/picks.txt'); "
        timeout 150 python3 -c "import sys; sys.path.insert(0, 'benchmarks'); from ab_moe_table import picked_tables
from mlaserve.kernels import fused_moe as fm
${P}from mlaserve.cli import main
sys.exit(main('bench one-batch --load-format dummy --model-config $V2L --batch-size 1 --input-len 256 --output-len 32'.split()))" \
          > "$OUT/moeab_$tag.log" 2>&1
        echo "$tag: $(grep -a '^| mlaserve' "$OUT/moeab_$tag.log" | cut -d'|' -f9-14)"
      done ;;
    *) echo "unknown part $PART" ;;
  esac
done
echo "=== done $(date +%T)"
