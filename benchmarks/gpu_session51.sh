#!/usr/bin/env bash
# Session of 2026-12-02 (fifth), one H200 (carry .whl: ../shared/device/wheels.sh). Issue 15's V3 prefill: the host.
#   hostprof: benchmarks/profile_prefill.py, V3 4L and V2-Lite 1 x 4096, with --timeline 4 (the host's ops and the
#             GPU's kernels of the first 4 ms) and --cprofile (the host's Python over 5 prefills)
#   prefill:  bench one-batch 1 x 4096 prefill, V3 4L then V2-Lite, two runs each (PREFILL_TAG names the files)
#   abhost:   benchmarks/ab_prefill_host.py 1 x 4096, the tree before this session's host change (_base/, carried:
#             git archive b73805b mlaserve | tar -x -C _base) and this tree alternated: V3 4L, then V2-Lite, twice each
#   abshared: the same A/B against _base/ = 5b85190 (before the shared experts side by side): V2-Lite at 4096 and
#             3000 tokens (a count cublas_linear pads to its bucket), twice each
#   profshared: profile_prefill.py V2-Lite 1 x 4096 and 1 x 3000 with the shared experts one GEMM pair each (the loop
#             before 5c886b9, patched in) and side by side, alternated: kernels, kernel time, GPU idle (not run yet:
#             the next session's)
#   tests:    the GPU tests of the changed host path (the one-copy upload, the Triton attention backend, the model's
#             GPU path, the overlap / cached-prompt scheduler tests; not the constrained one: this image has no
#             xgrammar, and that test ran past the part's 400 s in the first call)
#   bash benchmarks/gpu_session51.sh PART...
source benchmarks/gpu_v2l_env.sh
cat "$OUT/env.txt"
for PART in "$@"; do
  echo "=== $PART $(date +%T)"
  case $PART in
    hostprof)
      for m in $V3_4L $V2L; do
        f="$OUT/hostprof_$(basename $m .json).txt"
        timeout 240 python3 benchmarks/profile_prefill.py --model-config $m --len 4096 --timeline 4 --cprofile > "$f" 2>&1
        grep -v "loading\|Warn\|warn\|no tuned" "$f" | grep -A200 "GPU idle" | head -120
      done ;;
    prefill)
      for m in $V3_4L $V2L $V3_4L $V2L; do
        timeout 170 python3 -m mlaserve.cli bench one-batch --load-format dummy --model-config $m \
          --batch-size 1 --input-len 4096 --output-len 4 2>&1 | grep "^| mlaserve" | sed "s|^|$(basename $m) ${PREFILL_TAG:-} |"
      done ;;
    abhost)
      for m in $V3_4L $V2L; do
        n=2
        for i in $(seq $n); do
          for tree in base new; do
            pp=$PWD:/tmp/site; [ $tree = base ] && pp=$PWD/_base:/tmp/site
            # (the loader's progress bar ends without a newline: the figures' line is matched anywhere)
            PYTHONPATH=$pp timeout 150 python3 benchmarks/ab_prefill_host.py --model-config $m --tag $tree \
              > "$OUT/abhost.log" 2>&1
            grep -aoE "(base|new) .* prefills$" "$OUT/abhost.log" || tail -3 "$OUT/abhost.log"
          done
        done
      done ;;
    abshared)
      for len in 4096 3000; do
        for i in 1 2; do
          for tree in base new; do
            pp=$PWD:/tmp/site; [ $tree = base ] && pp=$PWD/_base:/tmp/site
            PYTHONPATH=$pp timeout 150 python3 benchmarks/ab_prefill_host.py --model-config $V2L --len $len \
              --tag $tree > "$OUT/abshared.log" 2>&1
            grep -aoE "(base|new) .* prefills$" "$OUT/abshared.log" || tail -3 "$OUT/abshared.log"
          done
        done
      done ;;
    profshared)
      loop="import mlaserve.layers.moe as m
def loop(self, x, slots):
    out = None
    for s in slots:
        gu = self._linear(x, self.w13[s], None if self.w13_scale is None else self.w13_scale[s])
        y = m.cublas_linear(self.ops.silu_and_mul(gu), self.w2[s]) if self.w2_scale is None else \\
            m.swiglu_fp8(self.ops, gu, self.w2[s], self.w2_scale[s])
        out = y if out is None else out + y
    return out
m.ExpertStack.dense_forward = loop"
      for len in 4096 3000; do
        for tag in pairs side pairs side; do
          p="import sys"; [ $tag = pairs ] && p="$loop"
          timeout 120 python3 -c "$p
import runpy, sys; sys.argv = ['profile_prefill.py', '--model-config', '$V2L', '--len', '$len']
runpy.run_path('benchmarks/profile_prefill.py', run_name='__main__')" > "$OUT/profshared.txt" 2>&1
          echo "$tag $len: $(grep -aoE 'prefill 1 x.*kernels$' "$OUT/profshared.txt") $(grep -a 'GPU idle' "$OUT/profshared.txt")"
        done
      done ;;
    tests)
      timeout 400 python3 -m pytest -q -p no:cacheprovider -rf tests/engine/test_forward_batch.py \
        tests/attention/test_triton_backend.py tests/models/test_gpu_fastpath.py tests/scheduler/test_overlap_sync.py \
        tests/scheduler/test_cached_prompt.py tests/kernels/test_mla_prefill.py tests/layers/test_moe.py \
        -k "not constrained" > "$OUT/tests.txt" 2>&1
      tail -6 "$OUT/tests.txt" ;;
  esac
done
