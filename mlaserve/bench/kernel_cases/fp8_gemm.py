"""Bench cases for `fp8_gemm` at DeepSeek-V3 block-FP8 linear shapes.

M <= 16 is judged on weight bandwidth (tbps = weight bytes / time), larger M on the fp8 tensor-core rate.
"""
from __future__ import annotations

from typing import Iterator

import torch

from mlaserve.bench.timing import Ceilings, time_cuda
from mlaserve.kernels.fp8_gemm import fp8_gemm, fp8_gemm_ref
from mlaserve.kernels.quant import block_quant_fp8_ref, per_token_group_quant_fp8

# (N, K) of DeepSeek-V3 linears: q_b_proj, kv_b_proj, o_proj, shared-expert gate_up and down,
# q_a_proj + kv_a_proj_with_mqa fused (1536 + 576).
V3_SHAPES = [(24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048), (2112, 7168)]
BATCHES = (1, 16, 2048, 4096)
BW_MAX_M = 16             # M <= 16 is judged on weight bandwidth, larger M on the fp8 tensor-core rate
TARGET_BW, TARGET_FP8 = 0.60, 0.55
TOL = 1e-2                # bf16 output: max |y - ref| <= 1e-2 * max |ref|


def gemm_flops(m: int, n: int, k: int) -> int:
    return 2 * m * n * k


def weight_bytes(n: int, k: int) -> int:
    """fp8 weight plus its float32 128x128 block scales."""
    return n * k + (-(-n // 128)) * (-(-k // 128)) * 4


def shape_grid(quick: bool) -> list[tuple[int, int, int]]:
    shapes = V3_SHAPES[:2] if quick else V3_SHAPES
    batches = (1, 4096) if quick else BATCHES
    return [(m, n, k) for n, k in shapes for m in batches]


def cases(ceil: Ceilings, quick: bool) -> Iterator[dict]:
    for m, n, k in shape_grid(quick):
        yield _case(ceil, m, n, k)


def _case(ceil: Ceilings, m: int, n: int, k: int) -> dict:
    w_q, w_s = block_quant_fp8_ref(torch.randn(n, k, device="cuda") * 0.02)
    x_q, x_s = per_token_group_quant_fp8(torch.randn(m, k, device="cuda", dtype=torch.bfloat16))
    ms = time_cuda(lambda: fp8_gemm(x_q, x_s, w_q, w_s))
    ref = fp8_gemm_ref(x_q, x_s, w_q, w_s, out_dtype=torch.float32)
    err = ((fp8_gemm(x_q, x_s, w_q, w_s).float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()
    sec = ms * 1e-3
    tbps, flops = weight_bytes(n, k) / sec, gemm_flops(m, n, k) / sec
    bw = m <= BW_MAX_M
    return dict(kernel="fp8_gemm", shape=f"M={m} N={n} K={k}", ms=ms, tbps=tbps / 1e12, tflops=flops / 1e12,
                mma="fp8", bound="bw" if bw else "fp8",
                frac=tbps / ceil["copy_bps"] if bw else flops / ceil["fp8_flops"],
                target=TARGET_BW if bw else TARGET_FP8, err=err, ok=err <= TOL)
