#!/usr/bin/env bash
# Several device jobs side by side on one multi-GPU machine, each on its own GPUs: on nvidia-h200-x4 two 2-GPU jobs
# (or a 2-GPU job and two 1-GPU ones) take one call's device time instead of two. Each job sees only its GPUs
# (CUDA_VISIBLE_DEVICES), writes under its own $OUT (/tmp/jobs/jN) and serves on its own $PORT (3N000; scripts
# that take no $PORT must not share a port with another job's). The wheels are installed once, before any job
# starts, and then moved aside so that no job's script installs them again while another imports them.
#   bash benchmarks/gpu_jobs.sh LIMIT_S "GPUS|COMMAND" ["GPUS|COMMAND" ...]
#   e.g. bash benchmarks/gpu_jobs.sh 540 "0,1|bash benchmarks/gpu_tp.sh allreduce" "2,3|ROWS=0 bash benchmarks/..."
# A job still running after LIMIT_S gets SIGUSR1 (mlaserve processes print their stacks), then SIGKILL, it and
# every process it started. At the end each job's log and $OUT are packed into $OUT/jN.tgz (the tool returns at most
# 8 files). Jobs share the machine's CPUs and host memory: their timings are reported as such, beside a baseline
# from the same job. $OUT/env.txt names the GPUs, the cores and a hash of the sources sent
# (run its `find ... | sha1sum` here to match it to a commit).
set -uo pipefail
LIMIT=$1; shift
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1   # never NVLink multicast
for w in .whlx .whl; do
  if [ -d $w ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site $w/*.whl > /dev/null 2>&1 \
      || echo "wheels from $w: install failed"
    rm -rf /tmp/wheels_installed_$w; mv $w /tmp/wheels_installed_$w        # (a warm machine keeps /tmp)
  fi
done
# NOTE: no `git log` here: the device's copy of .git can be older than the tree sent (it named the session's first
# commit in every call, 2026-11-27); a hash of the sources identifies the tree instead (the same command here)
{ nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader; nproc;
  echo "sources $(find mlaserve benchmarks -maxdepth 4 \( -name '*.py' -o -name '*.json' -o -name '*.sh' \) -print0 \
    | LC_ALL=C sort -z | xargs -0 cat | sha1sum | cut -c1-12)"
} > "$OUT/env.txt" 2>&1
# tree PID: PID and all its descendants (`timeout` moves its command to a process group of its own)
tree() { local c; echo $1; for c in $(ps -o pid= --ppid $1 2> /dev/null); do tree $c; done; }
pids=(); n=0
for job in "$@"; do
  gpus=${job%%|*}; cmd=${job#*|}
  d=/tmp/jobs/j$n; rm -rf $d; mkdir -p $d                      # (a warm machine keeps /tmp)
  echo "j$n on GPUs $gpus: $cmd" | tee -a "$OUT/env.txt"
  CUDA_VISIBLE_DEVICES=$gpus OUT=$d PORT=$((30000 + 1000 * n)) bash -c "$cmd" > $d/job.log 2>&1 &
  pids+=($!); n=$((n + 1))
done
t0=$(date +%s)
while [ $(( $(date +%s) - t0 )) -lt "$LIMIT" ]; do
  alive=0
  for p in "${pids[@]}"; do kill -0 $p 2> /dev/null && alive=1; done
  [ $alive = 1 ] || break
  sleep 2
done
for i in "${!pids[@]}"; do
  p=${pids[$i]}
  if kill -0 $p 2> /dev/null; then
    echo "j$i still running after $LIMIT s: USR1 (stacks), then killed" | tee -a /tmp/jobs/j$i/job.log
    all=$(tree $p); kill -USR1 $all 2> /dev/null; sleep 5; kill -KILL $(tree $p) $all 2> /dev/null
  fi
  wait $p; echo "j$i exit code $? at $(( $(date +%s) - t0 )) s" | tee -a /tmp/jobs/j$i/job.log "$OUT/env.txt"
  tar -C /tmp/jobs -czf "$OUT/j$i.tgz" j$i
done
