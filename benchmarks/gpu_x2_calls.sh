#!/usr/bin/env bash
# Device calls on nvidia-h200-x2 (two GPUs, 10 minutes a call) for issue 11, eighth session. Carry .whlx.
#   bash benchmarks/gpu_x2_calls.sh K   V2-Lite decode profile of one graph replay and of a 1 x 256 prefill at tp 1 and tp 2
#                                       (benchmarks/profile_decode_tp.py), bs 1 then tp 2 bs 64; then V3 20 layers FP8
#                                       at tp 2, one-batch bs 1 / 16 / 64, whole log
#   bash benchmarks/gpu_x2_calls.sh L   the peer all-reduce with PDL (9fa7d11): its GPU tests, then the tp 2 decode replay
#                                       profile at bs 1 and 64 against the tree before it (carried as .old, 82bf4e6),
#                                       alternating, then one-batch V2-Lite tp 1 against tp 2 (bs 1 / 16 / 64)
#   bash benchmarks/gpu_x2_calls.sh M   the prefill's host ops at tp 1 and tp 2, and tp 2 with the piecewise prefill graphs
#                                       (profile_decode_tp.py); the all-reduce alone (allreduce.py, after the PDL change);
#                                       V3 20 layers FP8 at tp 2, bs 64 (K's run ended before it)
#   bash benchmarks/gpu_x2_calls.sh N   the eager prefill's Python functions at tp 1 and tp 2 (cProfile, every rank)
#   bash benchmarks/gpu_x2_calls.sh Q   (ninth session) on H100s: tune the fused MoE at V2-Lite's tp 2 shape (E=64,N=704,
#                                       no H100 table yet), then one-batch V2-Lite tp 1 against tp 2 with it; on H200s:
#                                       V3 20 layers FP8 tp 2 at bs 64 alone, then the same one-batch
#   (R, the split-K fused MoE's tuning, ran at 8ff6895 and was reverted with it)
#   bash benchmarks/gpu_x2_calls.sh S   one-batch V2-Lite tp 1 / tp 2 (bs 1 / 16 / 64); V3 20 layers FP8 tp 2 bs 64 with
#                                       every process's stacks every 60 s and the GPUs' use every 30 s
#   bash benchmarks/gpu_x2_calls.sh T   (eleventh session) the epoch-race fix (9494828) on GPUs: V3 20 layers FP8 tp 2
#                                       bs 64 with the peer kernel taking calls up to 1 MiB (stopped in four of four
#                                       runs before the fix); peer_stress.py at hidden 7168, then V2-Lite's shapes with
#                                       the in-kernel sums and with the push kernel; the all-reduce alone
#   bash benchmarks/gpu_x2_calls.sh U   one-batch V2-Lite tp 1 / tp 2 at bs 1 / 16 / 64 (limit 300 s), then tp 2 with
#                                       $U_ENV (default: the push variant and the in-kernel sums on, 1 MiB bound)
#   bash benchmarks/gpu_x2_calls.sh V   at the new defaults (peer kernel up to 1 MiB, push variant auto, in-kernel sums
#                                       on): one-batch V2-Lite tp 1 against tp 2 and V3 20 layers FP8 tp 2 at bs 1 / 16 / 64;
#                                       peer_stress.py 6 rounds
#   bash benchmarks/gpu_x2_calls.sh X   the split push with the norm's sum of squares shared between a row's programs:
#                                       the all-reduce alone, the peer / tp GPU tests, peer_stress.py at hidden 7168
#   bash benchmarks/gpu_x2_calls.sh Y   one-batch V3 20 layers FP8 tp 2 at bs 1 / 8, MLASERVE_PEER_SPLIT=0 against 8
#                                       (the default), alternating, twice; then the peer / tp GPU tests
#   bash benchmarks/gpu_x2_calls.sh W   at the new defaults: the two-GPU tests of the peer kernels, tp 2, EP 2 and two
#                                       GPUs as two nodes serving (`SKIP_COMPILE=1 gpu_verify.sh`)
# Every output goes to $OUT (the whole logs too).
set -uo pipefail
W=.whlx; [ -d $W ] || W=.whl
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $W/*.whl > /dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site MLASERVE_CACHE=/tmp/mlaserve-cache
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1   # never NVLink multicast
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/env.txt"
# the device's .git may be stale: a hash of the sources names the tree (the same command here, at a commit)
echo "sources $(find mlaserve benchmarks -maxdepth 4 \( -name '*.py' -o -name '*.json' -o -name '*.sh' \) -print0 \
  | LC_ALL=C sort -z | xargs -0 cat | sha1sum | cut -c1-12)" >> "$OUT/env.txt"
P="python3 benchmarks/profile_decode_tp.py"
B="python3 -m mlaserve.cli bench one-batch --load-format dummy"
case "${1:-}" in
  K)
    for R in "1 1" "2 1" "2 64"; do
      set -- $R
      echo "== profile tp $1 bs $2 $(date +%T)"
      timeout 130 $P --tp-size $1 --bs $2 > "$OUT/prof_v2l_tp$1_bs$2.txt" 2>&1; echo "exit code $?" >> "$OUT/prof_v2l_tp$1_bs$2.txt"
      grep -A14 "^== decode" "$OUT/prof_v2l_tp$1_bs$2.txt"; grep -A8 "^== prefill" "$OUT/prof_v2l_tp$1_bs$2.txt"
      tail -2 "$OUT/prof_v2l_tp$1_bs$2.txt"
    done
    echo "== V3 20 layers tp 2 $(date +%T)"
    python3 benchmarks/v3_config.py --layers 20 --out /tmp/v3_20.json
    timeout 230 $B --model-config /tmp/v3_20.json --batch-size 1 16 64 --input-len 256 --output-len 32 --tp-size 2 \
      --output-file "$OUT/one_batch_v3_20l.md" > "$OUT/one_batch_v3_20l.log" 2>&1
    echo "exit code $?" >> "$OUT/one_batch_v3_20l.log"; grep "^|\|rror\|exit code" "$OUT/one_batch_v3_20l.log" | tail -8 ;;
  L)
    timeout 200 python3 -m pytest -q -p no:cacheprovider -m "multi_gpu or gpu" tests/distributed/test_peer.py \
      tests/distributed/test_tensor_parallel.py -k "gpu" 2>&1 | tail -6 | tee "$OUT/tests_peer_tp.txt"
    for R in 1 64; do
      for T in old new; do
        D=$PWD; [ $T = old ] && D=$PWD/.old
        (cd $D && PYTHONPATH=$D:/tmp/site timeout 100 python3 benchmarks/profile_decode_tp.py --tp-size 2 --bs $R) \
          > "$OUT/prof_tp2_bs${R}_$T.txt" 2>&1
        echo "$T: $(grep '^== decode' "$OUT/prof_tp2_bs${R}_$T.txt")"; grep -A4 "^== decode" "$OUT/prof_tp2_bs${R}_$T.txt" | tail -3
      done
    done
    C="--model-config mlaserve/tools/configs/deepseek-v2-lite.json --batch-size 1 16 64 --input-len 256 --output-len 32"
    timeout 200 $B $C --tp-size 1 2 --output-file "$OUT/one_batch_tp1_tp2.md" > "$OUT/one_batch_tp1_tp2.log" 2>&1
    echo "exit code $?"; grep "^|" "$OUT/one_batch_tp1_tp2.log" | tail -7 ;;
  M)
    for R in "1" "2" "2 --piecewise"; do
      F="$OUT/prof_prefill_tp${R// /}.txt"; F=${F//--/_}
      timeout 120 $P --tp-size $R --bs 1 > "$F" 2>&1; echo "exit code $?" >> "$F"
      echo "== tp $R"; grep "^== decode\|^== prefill\|^== host" "$F"; grep "^  rank" "$F" | head -24
    done
    timeout 90 python3 benchmarks/allreduce.py --tp-size 2 > "$OUT/allreduce.md" 2>&1; tail -12 "$OUT/allreduce.md"
    python3 benchmarks/v3_config.py --layers 20 --out /tmp/v3_20.json
    timeout 200 $B --model-config /tmp/v3_20.json --batch-size 64 --input-len 256 --output-len 32 --tp-size 2 \
      --output-file "$OUT/one_batch_v3_20l_bs64.md" > "$OUT/one_batch_v3_20l_bs64.log" 2>&1
    echo "exit code $?" >> "$OUT/one_batch_v3_20l_bs64.log"; grep "^|\|rror\|exit code" "$OUT/one_batch_v3_20l_bs64.log" | tail -5 ;;
  N)  # the eager prefill's Python side, tp 1 and tp 2 (cProfile)
    for R in 1 2; do
      CPROFILE=1 timeout 120 $P --tp-size $R --bs 1 > "$OUT/cprofile_tp$R.txt" 2>&1; echo "exit code $?" >> "$OUT/cprofile_tp$R.txt"
      grep "^== prefill\|^== host\|^== cProfile" "$OUT/cprofile_tp$R.txt"; grep "rank 0 " "$OUT/cprofile_tp$R.txt" | grep -v " calls " | head -34
    done ;;
  Q)
    C="--model-config mlaserve/tools/configs/deepseek-v2-lite.json --batch-size 1 16 64 --input-len 256 --output-len 32"
    if grep -q H100 "$OUT/env.txt"; then
      mkdir -p "$OUT/configs"
      echo "== tune E=64,N=704 bf16 on GPU 1 $(date +%T)"
      CUDA_VISIBLE_DEVICES=1 timeout 290 python3 -m mlaserve.cli tune fused-moe --model-config \
        mlaserve/tools/configs/deepseek-v2-lite.json --dtype bf16 --tp-size 2 --out-dir "$OUT/configs" \
        > "$OUT/tune_moe_tp2.txt" 2> "$OUT/tune_moe_tp2_err.txt"; echo "exit code $?"; tail -16 "$OUT/tune_moe_tp2.txt"
      cp "$OUT"/configs/*.json mlaserve/kernels/configs/ && tar -C "$OUT" -cf "$OUT/configs.tar" configs
    else
      echo "== V3 20 layers tp 2 bs 64 $(date +%T)"
      python3 benchmarks/v3_config.py --layers 20 --out /tmp/v3_20.json
      timeout 300 $B --model-config /tmp/v3_20.json --batch-size 64 --input-len 256 --output-len 32 --tp-size 2 \
        --output-file "$OUT/one_batch_v3_20l_bs64.md" > "$OUT/one_batch_v3_20l_bs64.log" 2>&1
      echo "exit code $?" >> "$OUT/one_batch_v3_20l_bs64.log"; grep "^|\|rror\|exit code" "$OUT/one_batch_v3_20l_bs64.log" | tail -5
    fi
    echo "== one-batch tp 1 / tp 2 $(date +%T)"
    timeout 220 $B $C --tp-size 1 2 --output-file "$OUT/one_batch_tp1_tp2.md" > "$OUT/one_batch_tp1_tp2.log" 2>&1
    echo "exit code $?"; grep "^|\|untuned\|no tuned" "$OUT/one_batch_tp1_tp2.log" | tail -9 ;;
  S)  # one-batch V2-Lite tp 1 / tp 2 at bs 1 / 16 / 64; V3 20 layers tp 2 bs 64 with stack dumps every 60 s
    V=mlaserve/tools/configs/deepseek-v2-lite.json
    timeout 240 $B --model-config $V --batch-size 1 16 64 --input-len 256 --output-len 32 --tp-size 1 2 \
      --output-file "$OUT/one_batch_tp1_tp2.md" > "$OUT/one_batch_tp1_tp2.log" 2>&1
    echo "exit code $?"; grep "^|" "$OUT/one_batch_tp1_tp2.log" | tail -8
    echo "== V3 20 layers tp 2 bs 64 $(date +%T)"
    python3 benchmarks/v3_config.py --layers 20 --out /tmp/v3_20.json
    (while sleep 30; do echo "$(date +%T) $(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader \
      | tr '\n' ' ')"; done) > "$OUT/v3_smi.txt" 2>&1 &
    MLASERVE_DUMP_STACKS_EVERY=60 timeout 270 $B --model-config /tmp/v3_20.json --batch-size 64 --input-len 256 \
      --output-len 32 --tp-size 2 --output-file "$OUT/one_batch_v3_20l_bs64.md" > "$OUT/one_batch_v3_20l_bs64.log" 2>&1
    echo "exit code $?" >> "$OUT/one_batch_v3_20l_bs64.log"; kill %1
    grep "^|\|rror\|exit code" "$OUT/one_batch_v3_20l_bs64.log" | tail -5; cat "$OUT/v3_smi.txt" ;;
  T)
    echo "== V3 20 layers tp 2 bs 64, peer kernel up to 1 MiB $(date +%T)"
    python3 benchmarks/v3_config.py --layers 20 --out /tmp/v3_20.json
    (while sleep 30; do echo "$(date +%T) $(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader \
      | tr '\n' ' ')"; done) > "$OUT/v3_smi.txt" 2>&1 &
    MLASERVE_PEER_MAX_BYTES=1048576 MLASERVE_DUMP_STACKS_EVERY=60 timeout 240 $B --model-config /tmp/v3_20.json \
      --batch-size 64 --input-len 256 --output-len 32 --tp-size 2 --output-file "$OUT/one_batch_v3_20l_bs64_peer.md" \
      > "$OUT/one_batch_v3_20l_bs64_peer.log" 2>&1
    echo "exit code $?" >> "$OUT/one_batch_v3_20l_bs64_peer.log"; kill %1
    grep "^|\|rror\|exit code" "$OUT/one_batch_v3_20l_bs64_peer.log" | tail -5
    for R in "h7168 --hidden 7168" "sums1 --sums 1" "sums0 --sums 0"; do
      set -- $R; N=$1; shift
      echo "== peer_stress $N $(date +%T)"
      timeout 110 python3 benchmarks/peer_stress.py --phase-timeout 45 "$@" > "$OUT/peer_stress_$N.txt" 2>&1
      echo "exit code $?" | tee -a "$OUT/peer_stress_$N.txt"; grep -v "^ \|^File\|^Thread\|^Current" "$OUT/peer_stress_$N.txt" | tail -12
    done
    echo "== the all-reduce alone $(date +%T)"
    timeout 90 python3 benchmarks/allreduce.py --tp-size 2 > "$OUT/allreduce.txt" 2>&1
    echo "exit code $?" | tee -a "$OUT/allreduce.txt"; tail -14 "$OUT/allreduce.txt" ;;
  U)
    V=mlaserve/tools/configs/deepseek-v2-lite.json
    C="--model-config $V --batch-size 1 16 64 --input-len 256 --output-len 32"
    echo "== one-batch tp 1 / tp 2 $(date +%T)"
    MLASERVE_DUMP_STACKS_EVERY=60 timeout 300 $B $C --tp-size 1 2 --output-file "$OUT/one_batch_tp1_tp2.md" \
      > "$OUT/one_batch_tp1_tp2.log" 2>&1
    echo "exit code $?"; grep "^|" "$OUT/one_batch_tp1_tp2.log" | tail -8
    U_ENV=${U_ENV:-"MLASERVE_PEER_PUSH=auto MLASERVE_KERNEL_SUMS=1 MLASERVE_PEER_MAX_BYTES=1048576"}
    echo "== one-batch tp 2 with $U_ENV $(date +%T)"
    env $U_ENV MLASERVE_DUMP_STACKS_EVERY=60 timeout 200 $B $C --tp-size 2 --output-file "$OUT/one_batch_tp2_env.md" \
      > "$OUT/one_batch_tp2_env.log" 2>&1
    echo "exit code $?"; grep "^|" "$OUT/one_batch_tp2_env.log" | tail -8 ;;
  V)
    V=mlaserve/tools/configs/deepseek-v2-lite.json
    echo "== one-batch V2-Lite tp 1 and tp 2 $(date +%T)"
    MLASERVE_DUMP_STACKS_EVERY=60 timeout 200 $B --model-config $V --batch-size 1 16 64 --input-len 256 --output-len 32 \
      --tp-size 1 2 --output-file "$OUT/one_batch_v2l_tp2.md" > "$OUT/one_batch_v2l_tp2.log" 2>&1
    echo "exit code $?"; grep "^|" "$OUT/one_batch_v2l_tp2.log" | tail -7
    echo "== V3 20 layers tp 2 $(date +%T)"
    python3 benchmarks/v3_config.py --layers 20 --out /tmp/v3_20.json
    MLASERVE_DUMP_STACKS_EVERY=60 timeout 220 $B --model-config /tmp/v3_20.json --batch-size 1 16 64 --input-len 256 \
      --output-len 32 --tp-size 2 --output-file "$OUT/one_batch_v3_20l.md" > "$OUT/one_batch_v3_20l.log" 2>&1
    echo "exit code $?"; grep "^|\|rror" "$OUT/one_batch_v3_20l.log" | tail -5
    echo "== peer_stress 6 rounds $(date +%T)"
    timeout 100 python3 benchmarks/peer_stress.py --phase-timeout 45 --rounds 6 > "$OUT/peer_stress_r6.txt" 2>&1
    echo "exit code $?"; grep -v "^ \|^File\|^Thread\|^Current" "$OUT/peer_stress_r6.txt" | tail -4 ;;
  W)
    SKIP_COMPILE=1 bash benchmarks/gpu_verify.sh ;;
  X)
    echo "== the all-reduce alone $(date +%T)"
    timeout 120 python3 benchmarks/allreduce.py --tp-size 2 > "$OUT/allreduce.txt" 2>&1
    echo "exit code $?" | tee -a "$OUT/allreduce.txt"; tail -12 "$OUT/allreduce.txt"
    echo "== GPU tests $(date +%T)"
    timeout 150 python3 -m pytest -q -p no:cacheprovider -m "multi_gpu or gpu" tests/distributed/test_peer.py \
      tests/distributed/test_tensor_parallel.py -k "gpu" > "$OUT/tests_peer_tp.txt" 2>&1
    echo "exit code $?" >> "$OUT/tests_peer_tp.txt"; tail -4 "$OUT/tests_peer_tp.txt"
    echo "== peer_stress h7168 $(date +%T)"
    timeout 100 python3 benchmarks/peer_stress.py --phase-timeout 45 --hidden 7168 > "$OUT/peer_stress_h7168.txt" 2>&1
    echo "exit code $?"; grep -v "^ \|^File\|^Thread\|^Current" "$OUT/peer_stress_h7168.txt" | tail -8 ;;
  Y)
    python3 benchmarks/v3_config.py --layers 20 --out /tmp/v3_20.json
    for S in 0 8 0 8; do
      echo "== one-batch v3 20 layers tp 2 bs 1 8 MLASERVE_PEER_SPLIT=$S $(date +%T)"
      MLASERVE_PEER_SPLIT=$S MLASERVE_DUMP_STACKS_EVERY=60 timeout 120 $B --model-config /tmp/v3_20.json \
        --batch-size 1 8 --input-len 256 --output-len 32 --tp-size 2 >> "$OUT/one_batch_v3_split$S.log" 2>&1
      echo "exit code $?" | tee -a "$OUT/one_batch_v3_split$S.log"; grep "^|" "$OUT/one_batch_v3_split$S.log" | tail -2
    done
    echo "== GPU tests $(date +%T)"
    timeout ${TESTS_S:-240} python3 -m pytest -q -p no:cacheprovider --durations=10 -m "multi_gpu or gpu" \
      tests/distributed/test_peer.py tests/distributed/test_tensor_parallel.py -k "gpu" > "$OUT/tests_peer_tp.txt" 2>&1
    echo "exit code $?" >> "$OUT/tests_peer_tp.txt"; tail -16 "$OUT/tests_peer_tp.txt" ;;
  *) echo "usage: $0 K|L|M|N|Q|S|T|U|V|W|X|Y"; exit 2 ;;
esac
