"""Sum over the middle axis, fp32 accumulation: the combine of fused_moe's K weighted rows per token and of
fp8_gemm's split-K partials. One small launch where torch's generic reduction costs several microseconds.

Shapes: x [A, B, C] -> out [A, C], B small (top-k + shared slots, split-K parts).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from mlaserve.kernels.pdl import pdl_enter, pdl_meta


@triton.jit
def bf16_rne(v):
    """Round fp32 to bf16 precision, ties to even (interpreter only: its own fp32 -> bf16 cast truncates)."""
    bits = v.to(tl.int32, bitcast=True)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) & -0x10000).to(tl.float32, bitcast=True)


@triton.jit
def _sum_dim1_kernel(x_ptr, out_ptr, B, C, stride_xa, stride_xb, stride_oa, ROUND_BF16: tl.constexpr,
                     BLOCK_B: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr):
    # Grid (A, C / BLOCK_C): one [B, BLOCK_C] tile summed down its rows.
    pdl_enter(PDL)
    a = tl.program_id(0).to(tl.int64)
    offs_b = tl.arange(0, BLOCK_B)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ptrs = x_ptr + a * stride_xa + offs_b[:, None] * stride_xb + offs_c[None, :]
    acc = tl.sum(tl.load(ptrs, mask=(offs_b < B)[:, None] & (offs_c < C)[None, :], other=0.0).to(tl.float32),
                 axis=0)
    if ROUND_BF16:
        acc = bf16_rne(acc)
    tl.store(out_ptr + a * stride_oa + offs_c, acc.to(out_ptr.dtype.element_ty), mask=offs_c < C)


@triton.jit(do_not_specialize=["A"])
def _sum_rows_kernel(x_ptr, out_ptr, A, B, C, stride_xa, stride_xb, stride_oa, ROUND_BF16: tl.constexpr,
                     BLOCK_A: tl.constexpr, BLOCK_C: tl.constexpr, PDL: tl.constexpr):
    # Grid (A / BLOCK_A, C / BLOCK_C): a [BLOCK_A, BLOCK_C] tile of out, the B rows of each added one at a time (each
    # load BLOCK_A runs of BLOCK_C contiguous values: many rows, long runs, for prefill sizes).
    pdl_enter(PDL)
    offs_a = tl.program_id(0) * BLOCK_A + tl.arange(0, BLOCK_A)
    offs_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = (offs_a < A)[:, None] & (offs_c < C)[None, :]
    ptrs = x_ptr + offs_a.to(tl.int64)[:, None] * stride_xa + offs_c[None, :]
    acc = tl.zeros((BLOCK_A, BLOCK_C), dtype=tl.float32)
    for _ in range(B):
        acc += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        ptrs += stride_xb
    if ROUND_BF16:
        acc = bf16_rne(acc)
    tl.store(out_ptr + offs_a.to(tl.int64)[:, None] * stride_oa + offs_c[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mask)


# (BLOCK_A, BLOCK_C, warps) of `sum_dim1`'s row-blocked kernel (rows=True). benchmarks/bench_combine.py on an H200
# (benchmarks/results/prequant-h200.md), 7 tiles: (8, 256, 4) the fastest or within 1 us of it at every shape from
# 1024 tokens; against torch.sum at 4096 tokens, [T, 6, 2048] 57.6 -> 38.6 us, [T, 8, 7168] 169.4 -> 140.4 us.
SUM_ROWS_CONFIG = (8, 256, 4)


def sum_dim1(x: torch.Tensor, out: torch.Tensor | None = None, rows: bool = False) -> torch.Tensor:
    """out [A, C] = x [A, B, C].sum(1), accumulated in fp32, rounded once to out's dtype (default x.dtype).

    x's last dim and out's rows must be contiguous; B up to 64. rows: a program sums a block of SUM_ROWS_CONFIG rows
    of A (each of the B rows added in turn) rather than all B rows of one A (prefill sizes; any B).
    """
    assert x.dim() == 3 and x.stride(2) == 1, f"x must be [A, B, C] with contiguous rows, got {tuple(x.shape)}"
    a, b, c = x.shape
    assert rows or b <= 64, f"sum_dim1 sums up to 64 rows, got B={b}"
    out = torch.empty(a, c, dtype=x.dtype, device=x.device) if out is None else out
    assert out.shape == (a, c) and out.stride(1) == 1, f"out must be [{a}, {c}] with contiguous rows"
    if a == 0 or c == 0:
        return out
    if b == 0:
        return out.zero_()
    if rows:
        block_a, block_c, warps = SUM_ROWS_CONFIG
        _sum_rows_kernel[(triton.cdiv(a, block_a), triton.cdiv(c, block_c))](
            x, out, a, b, c, x.stride(0), x.stride(1), out.stride(0),
            ROUND_BF16=not x.is_cuda and out.dtype == torch.bfloat16, BLOCK_A=block_a, BLOCK_C=block_c,
            **pdl_meta(x.device), num_warps=warps)
        return out
    block_b = triton.next_power_of_2(b)
    block_c = max(64, min(1024, 4096 // block_b, triton.next_power_of_2(c)))
    _sum_dim1_kernel[(a, triton.cdiv(c, block_c))](
        x, out, b, c, x.stride(0), x.stride(1), out.stride(0),
        ROUND_BF16=not x.is_cuda and out.dtype == torch.bfloat16, BLOCK_B=block_b, BLOCK_C=block_c,
        **pdl_meta(x.device), num_warps=4)
    return out


def sum_dim1_ref(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The spec of `sum_dim1`."""
    y = x.float().sum(dim=1).to(x.dtype if out is None else out.dtype)
    return y if out is None else out.copy_(y)
