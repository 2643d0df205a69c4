"""Block-scaled FP8 GEMM: y = (x_q * x_scale) @ (w_q * w_scale_inv)^T with fp32 accumulation.

Shapes: x_q [M, K] e4m3 with x_scale [M, ceil(K/128)] (per token per 128 channels),
w_q [N, K] e4m3 with w_scale_inv [ceil(N/128), ceil(K/128)], y [M, N].
"""
from __future__ import annotations

import torch

from mlaserve.kernels.quant import block_dequant_ref


def fp8_gemm_ref(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale_inv: torch.Tensor,
                 out_dtype: torch.dtype = torch.bfloat16, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """Reference: dequantise both operands to fp32 and multiply (the spec of `fp8_gemm`)."""
    m, k = x_q.shape
    x = x_q.float() * x_scale.repeat_interleave(block[1], dim=1)[:, :k]
    w = block_dequant_ref(w_q, w_scale_inv, block, torch.float32)
    return (x @ w.t()).to(out_dtype)
