#!/usr/bin/env bash
# Session of 2026-12-02 (second), one H200 (carry .whl: ../shared/device/wheels.sh, then benchmarks/xgrammar_wheels.sh):
# the L2 prefetch of the weights after the attention (mlaserve/kernels/prefetch.py), and last session's open checks
# (results in benchmarks/results/l2-prefetch-h200.md).
#   tests:   the prefetch tests, the W_UK launch's, the MLA decode kernel's (split_bounds), the Triton backend's, the
#            fast path against the reference (graphs, torch.compile)
#   probe:   benchmarks/probe_l2_prefetch.py (a one-row linear after a ~20 us idle spin, with and without the job)
#   ab:      bench one-batch V2-Lite bs 1 / 16 / 64 in 256 out 32 (AB_CFG: v2l or v3; AB_BS, AB_IN), prefetch off
#            (MLASERVE_L2_PREFETCH_MB=0) and on (AB_MB, default 32; AB_MAXT largest prefetching batch, default 16),
#            alternated (AB_TAGS, default off on off on)
#   profile: benchmarks/profile_decode.py V2-Lite bs 1 (PROF_BS), prefetch budgets PROF_MBS (default 0 32)
#   warps:   last session's repeat: the H=16 MLA decode at 4 warps against 8, bs 64 at 4096 tokens, alternated
#   bash benchmarks/gpu_session48.sh PART...
source benchmarks/gpu_v2l_env.sh
cat "$OUT/env.txt"
for PART in "$@"; do
  echo "=== $PART $(date +%T)"
  case $PART in
    tests)
      timeout 300 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_prefetch.py tests/kernels/test_mla_absorb.py \
        tests/kernels/test_mla_decode.py tests/attention/test_triton_backend.py tests/models/test_gpu_fastpath.py \
        -k "not logprobs_through_the_runner" > "$OUT/tests.txt" 2>&1; tail -3 "$OUT/tests.txt" ;;
    probe)
      timeout 200 python3 benchmarks/probe_l2_prefetch.py 2>&1 | grep -v Warn | tee "$OUT/probe.txt" ;;
    ab)
      cfg=$V2L; [ "${AB_CFG:-v2l}" = v3 ] && cfg=$V3_4L
      for tag in ${AB_TAGS:-off on off on}; do
        mb=0; [ $tag = on ] && mb=${AB_MB:-32}
        echo "### $tag (MB $mb)"
        MLASERVE_L2_PREFETCH_MB=$mb MLASERVE_L2_PREFETCH_MAX_TOKENS=${AB_MAXT:-16} timeout 200 python3 -m mlaserve.cli \
          bench one-batch --load-format dummy --input-len ${AB_IN:-256} --output-len 32 --model-config "$cfg" \
          --batch-size ${AB_BS:-1 16 64} --output-file "$OUT/ab_${AB_CFG:-v2l}_$tag.md" 2>&1 | grep "^| mlaserve" | tail -3
      done ;;
    profile)
      for mb in ${PROF_MBS:-0 32}; do
        MLASERVE_L2_PREFETCH_MB=$mb timeout 150 python3 benchmarks/profile_decode.py --bs ${PROF_BS:-1} \
          > "$OUT/prof_bs${PROF_BS:-1}_mb$mb.txt" 2>&1
        grep -v "loading weights" "$OUT/prof_bs${PROF_BS:-1}_mb$mb.txt" | head -16
      done ;;
    warps)
      old="import sys, mlaserve.kernels.mla_decode as m; m.CONFIGS[16] = m.MLADecodeConfig(16, 64, 4, 2)"
      for tag in old new old new; do
        patch="import sys"; [ $tag = old ] && patch="$old"
        echo "### $tag"
        timeout 150 python3 -c "$patch; from mlaserve.cli import main; sys.exit(main())" bench one-batch \
          --load-format dummy --input-len 4096 --output-len 16 --model-config "$V2L" --batch-size 64 \
          --output-file "$OUT/warps_$tag.md" 2>&1 | grep "^| mlaserve" | tail -1
      done ;;
  esac
done
