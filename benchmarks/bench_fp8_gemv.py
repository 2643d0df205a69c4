"""Decode-size block-FP8 linears on the GPU: `fp8_gemv` against the `fp8_gemm` path of `fp8_linear`, us and TB/s.

Shapes: DeepSeek-V3's FP8 linears at tp 1 (N, K), M = 1, 2, 4, 8, 16 rows of bf16 activations (the gemv takes
M > FP8_GEMV_MAX_M with a wider activation tile, forced, to show where FP8_GEMV_MAX_M should sit). Every time: median
of CUDA-graph replays with the L2 flushed before each (`time_cuda`); TB/s counts weight bytes with their scales; "of
copy" is that over the device-to-device copy rate measured in the same run. Then the 18 calls of V3 4 layers at bs 1
(the profile's mix), and with --sweep a small search over the gemv's block_n / num_stages / split-K at M = 1.
Usage: PYTHONPATH=$PWD python3 benchmarks/bench_fp8_gemv.py [--sweep]
"""
from __future__ import annotations

import sys

import torch
import triton

from mlaserve.bench.timing import measure_copy_bandwidth, time_cuda
from mlaserve.kernels import pdl
from mlaserve.kernels.fp8_gemm import fp8_linear
from mlaserve.kernels.fp8_gemv import FP8_GEMV_MAX_M, Fp8GemvConfig, fp8_gemv, fp8_gemv_config
from mlaserve.kernels.quant import block_quant_fp8_ref

# name: (N, K, calls in V3 4 layers at bs 1: three dense layers and one MoE layer)
V3_LINEARS = {"q_a+kv_a": (2112, 7168, 4), "q_b": (24576, 1536, 4), "o_proj": (7168, 16384, 4),
              "dense gate_up": (36864, 7168, 3), "dense down": (7168, 18432, 3), "shared gate_up": (4096, 7168, 1),
              "shared down": (7168, 2048, 1)}
ROWS = (1, 2, 4, 8, 16)
DEV = "cuda"


def weight_bytes(n: int, k: int) -> int:
    return n * k + triton.cdiv(n, 128) * triton.cdiv(k, 128) * 4


def weights(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    return block_quant_fp8_ref(torch.randn(n, k, device=DEV) * k ** -0.5)


def compare(copy_bps: float) -> None:
    print(f"\n{'linear':15} {'N':>6} {'K':>6} {'M':>3} | {'gemm us':>8} {'TB/s':>5} {'copy':>5} | {'gemv us':>8} "
          f"{'TB/s':>5} {'copy':>5} | {'speedup':>7} {'max abs diff':>12}")
    step_gemm = step_gemv = 0.0                                          # the 18 calls at M = 1
    for name, (n, k, calls) in V3_LINEARS.items():
        t_gemm, t_gemv = compare_shape(name, n, k, copy_bps)
        step_gemm, step_gemv = step_gemm + calls * t_gemm, step_gemv + calls * t_gemv
        torch.cuda.empty_cache()
    nbytes = sum(calls * weight_bytes(n, k) for n, k, calls in V3_LINEARS.values())
    print(f"\nV3 4 layers bs 1, 18 calls, {nbytes / 1e9:.2f} GB: gemm {step_gemm * 1e6:.0f} us "
          f"({nbytes / step_gemm / copy_bps:.0%} of copy), gemv {step_gemv * 1e6:.0f} us "
          f"({nbytes / step_gemv / copy_bps:.0%})")


def compare_shape(name: str, n: int, k: int, copy_bps: float) -> tuple[float, float]:
    """Prints one row per M; returns the (gemm, gemv) seconds at M = 1."""
    w_q, w_s = weights(n, k)
    nbytes, at_one = weight_bytes(n, k), None
    for m in ROWS:
        x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
        gemm = fp8_linear(x, w_q, w_s, gemv=False)
        diff = (fp8_linear(x, w_q, w_s, gemv=True).float() - gemm.float()).abs().max().item()
        t_gemm = time_cuda(lambda: fp8_linear(x, w_q, w_s, gemv=False)) * 1e-3
        t_gemv = time_cuda(lambda: fp8_linear(x, w_q, w_s, gemv=True)) * 1e-3
        at_one = at_one or (t_gemm, t_gemv)
        bw_gemm, bw_gemv = nbytes / t_gemm, nbytes / t_gemv
        print(f"{name:15} {n:6d} {k:6d} {m:3d} | {t_gemm * 1e6:8.1f} {bw_gemm / 1e12:5.2f} {bw_gemm / copy_bps:5.0%} | "
              f"{t_gemv * 1e6:8.1f} {bw_gemv / 1e12:5.2f} {bw_gemv / copy_bps:5.0%} | {t_gemm / t_gemv:7.2f} "
              f"{diff:12.2e}{'' if m <= FP8_GEMV_MAX_M else '  (forced)'}", flush=True)
    return at_one


def sweep(copy_bps: float, num_sms: int) -> None:
    print("\nsweep at M = 1 (gemv): block_n x num_stages x split-K around the rule's; TB/s, of copy")
    for name, (n, k, _) in V3_LINEARS.items():
        sweep_shape(name, n, k, copy_bps, num_sms)
        torch.cuda.empty_cache()


def sweep_shape(name: str, n: int, k: int, copy_bps: float, num_sms: int) -> None:
    w_q, w_s = weights(n, k)
    x = torch.randn(1, k, device=DEV, dtype=torch.bfloat16)
    results = []
    for block_n in (64, 128):
        base = fp8_gemv_config(n, k, num_sms, block_n)
        for split in sorted({max(1, base.split_k // 2), base.split_k, min(k // 128, base.split_k * 2)}):
            for stages in (3, 4, 6):
                cfg = Fp8GemvConfig(block_n, split, 4, stages)
                results.append((time_cuda(lambda: fp8_gemv(x, w_q, w_s, config=cfg)) * 1e-3, cfg))
    default = fp8_gemv_config(n, k, num_sms)
    t_default = next(t for t, c in results if c == default)
    t_best, best = min(results, key=lambda r: r[0])
    nbytes = weight_bytes(n, k)
    print(f"{name:15} default {tuple(default)}: {nbytes / t_default / 1e12:.2f} TB/s "
          f"{nbytes / t_default / copy_bps:.0%} | best {tuple(best)}: {nbytes / t_best / 1e12:.2f} TB/s "
          f"{nbytes / t_best / copy_bps:.0%}", flush=True)


def main(argv: list[str]) -> int:
    if not torch.cuda.is_available():
        print("bench_fp8_gemv needs a CUDA GPU")
        return 1
    copy_bps = measure_copy_bandwidth()
    props = torch.cuda.get_device_properties(0)
    print(f"fp8 decode linears on {props.name} ({props.multi_processor_count} SMs), torch {torch.__version__}, "
          f"triton {triton.__version__}, PDL {'on' if pdl.active(torch.device('cuda')) else 'off'}; "
          f"copy {copy_bps / 1e12:.2f} TB/s; FP8_GEMV_MAX_M = {FP8_GEMV_MAX_M}")
    compare(copy_bps)
    if "--sweep" in argv:
        sweep(copy_bps, props.multi_processor_count)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
