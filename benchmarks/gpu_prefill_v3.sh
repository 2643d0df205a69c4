#!/usr/bin/env bash
# Issue 15, V3 prefill on one H100 (carry .whl): the block-FP8 GEMM paths at prefill sizes (ours beside cuBLAS's
# block-scaled matmul), the V3 4L FP8 1 x 4096 prefill's kernels, and the one-batch prefill with and without cuBLAS.
#   bash benchmarks/gpu_prefill_v3.sh [tests|models|cublas|linear|host|align|ab|piecewise|final|table|prefill|all ...]
source benchmarks/gpu_v2l_env.sh
PARTS=${*:-all}
has() { [[ " $PARTS " == *" $1 "* || " $PARTS " == *" all "* ]]; }
cat "$OUT/env.txt"
if has tests; then
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_gemm.py tests/kernels/test_quant.py \
    tests/kernels/test_fp8_gemv.py > "$OUT/tests.txt" 2>&1
  tail -5 "$OUT/tests.txt"
fi
if has models; then   # the model paths the changes touch: greedy equality against the reference, log-probs against HF
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gemv.py tests/models/test_gpu_fastpath.py \
    > "$OUT/model_tests.txt" 2>&1
  tail -3 "$OUT/model_tests.txt"
fi
if has cublas; then
  timeout 300 python3 benchmarks/probe_fp8_cublas.py > "$OUT/fp8_cublas.txt" 2>&1
  grep -v Warning "$OUT/fp8_cublas.txt" | tail -40
fi
if has linear; then
  timeout 300 python3 benchmarks/probe_fp8_cublas.py --linear --m 96 128 130 4093 \
    > "$OUT/fp8_linear.txt" 2>&1
  grep -v Warning "$OUT/fp8_linear.txt" | tail -34
fi
if has host; then
  timeout 200 python3 benchmarks/probe_fp8_cublas.py --host > "$OUT/fp8_host.txt" 2>&1
  grep -v Warning "$OUT/fp8_host.txt" | tail -14
fi
if has ab; then   # one-batch 1 x 4096 prefill of V3 4L FP8, the Triton GEMM (off) and cuBLAS (on) alternated
  for tag in off on off on; do
    patch="import mlaserve.kernels.fp8_gemm as f"
    [ $tag = off ] && patch="$patch; f.CUBLAS_BLOCK_FP8_MIN_M = 1 << 40"
    timeout 150 python3 -c "import sys; $patch; from mlaserve.cli import main; sys.exit(main())" bench one-batch \
      --load-format dummy --model-config $V3_4L --batch-size 1 --input-len 4096 --output-len 4 \
      --output-file "$OUT/one_batch_prefill_$tag.md" 2>&1 | grep "^| mlaserve" | cut -d'|' -f3-9 | sed "s/^/$tag /"
  done
fi
if has align; then   # the MoE align's three paths forced, prefill sizes included; its GPU tests
  timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fused_moe.py -k align > "$OUT/align_tests.txt" 2>&1
  tail -2 "$OUT/align_tests.txt"
  timeout 300 python3 benchmarks/bench_moe_align.py --tokens 64 256 1024 2048 4096 8192 > "$OUT/align.txt" 2>&1
  grep -v Warning "$OUT/align.txt" | tail -20
fi
if has piecewise; then   # the same prefill through piecewise CUDA graphs (host out of the way), then V3 4L decode at
  # bs 128 (the first graph size whose linears reach the cuBLAS path), Triton GEMM (off) and cuBLAS (on)
  for tag in off on off on; do
    patch="import mlaserve.kernels.fp8_gemm as f"
    [ $tag = off ] && patch="$patch; f.CUBLAS_BLOCK_FP8_MIN_M = 1 << 40"
    timeout 200 python3 -c "import sys; $patch; from mlaserve.cli import main; sys.exit(main())" bench one-batch \
      --load-format dummy --model-config $V3_4L --batch-size 1 --input-len 4096 --output-len 4 \
      --enable-piecewise-cuda-graph --output-file "$OUT/one_batch_piecewise_$tag.md" 2>&1 | grep "^| mlaserve" \
      | cut -d'|' -f3-9 | sed "s/^/$tag piecewise /"
    timeout 150 python3 -c "import sys; $patch; from mlaserve.cli import main; sys.exit(main())" bench one-batch \
      --load-format dummy --model-config $V3_4L --batch-size 128 --input-len 256 --output-len 32 \
      --output-file "$OUT/one_batch_bs128_$tag.md" 2>&1 | grep "^| mlaserve" | cut -d'|' -f3,9,10,12,13,14 \
      | sed "s/^/$tag decode /"
  done
fi
if has final; then   # the kernel tests the session's changes touch, then the table below
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_gemm.py tests/kernels/test_quant.py \
    tests/kernels/test_fused_moe.py tests/kernels/test_gemv.py > "$OUT/final_tests.txt" 2>&1
  tail -2 "$OUT/final_tests.txt"
fi
if has final || has table; then   # issue 15's one-batch table at this tree
  B="python3 -m mlaserve.cli bench one-batch --load-format dummy"
  timeout 150 $B --model-config $V2L --batch-size 1 16 64 --input-len 256 --output-len 32 \
    --output-file "$OUT/final_v2l.md" 2>&1 | grep "^| mlaserve" | cut -d'|' -f3-14
  timeout 150 $B --model-config $V2L --batch-size 1 --input-len 4096 --output-len 4 \
    --output-file "$OUT/final_v2l_prefill.md" 2>&1 | grep "^| mlaserve" | cut -d'|' -f3-9
  timeout 200 $B --model-config $V3_4L --batch-size 1 16 64 --input-len 256 --output-len 32 \
    --output-file "$OUT/final_v3.md" 2>&1 | grep "^| mlaserve" | cut -d'|' -f3-14
  timeout 150 $B --model-config $V3_4L --batch-size 1 --input-len 4096 --output-len 4 \
    --output-file "$OUT/final_v3_prefill.md" 2>&1 | grep "^| mlaserve" | cut -d'|' -f3-9
fi
if has prefill; then
  timeout 200 python3 benchmarks/profile_prefill.py --model-config $V3_4L --len 4096 --syncs > "$OUT/prefill_v3_4096.txt" 2>&1
  grep -A30 "^config" "$OUT/prefill_v3_4096.txt" | head -32; grep -A40 "^host CUDA" "$OUT/prefill_v3_4096.txt"
fi
