"""Weight-streaming block-FP8 GEMM for decode batch sizes: y [M, N] = quant(x) [M, K] @ dequant(w_q, w_scale_inv)^T.

At M <= FP8_GEMV_MAX_M a block-FP8 linear is a read of w_q (N * K bytes) and its scales, and nothing else. Each
program owns BLOCK_N rows of w_q and one range of K (split-K where N alone gives too few programs) and streams it in
128-channel steps, one scale group each, through a multi-stage pipeline. Activations are quantised in registers as
`per_token_group_quant_fp8` does (bit-identical codes and scales), so the layer is one launch (two with split-K).
fp8_gemm's decode tiles (16 x 64 x 128) quantise 16 rows for every 8 KB weight step, ~560 instructions per thread, over
half of an SM's issue slots at 3 TB/s (sm_90 SASS); here BLOCK_M rows per 16 KB step, with 48 KB in flight a program.

Shapes: `M` rows (tokens), `N` output features, `K` input features, `G = K / 128` scale groups, `S` K-splits.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from mlaserve.kernels.pdl import pdl_enter, pdl_meta, pdl_release
from mlaserve.kernels.quant import quant_group_rows
from mlaserve.kernels.reduce import sum_dim1

# Rows the gemv takes, and the rows of its activation tile (BLOCK_M: one compile for every M up to it). Each program
# quantises BLOCK_M rows per 128-channel step whatever M is, and that is most of the loop's instructions: compiled
# for sm_90 (Triton 3.6, SASS) a 128 x 128 weight step issues ~330 / 370 / 440 / 690 instructions per thread at
# BLOCK_M = 1 / 4 / 8 / 16, about 26 / 29 / 35 / 55% of an SM's issue slots while it streams its share of 3 TB/s.
# 4 keeps M = 1 within ~12% of a one-row loop. To be set from the GPU measurement: benchmarks/bench_fp8_gemv.py
# times the gemv against the fp8_gemm path at M = 1, 2, 4, 8, 16 (above this constant with a wider tile).
FP8_GEMV_MAX_M = 4
GROUP = 128                   # channels per activation / weight scale group (DeepSeek-V3 block FP8)
BLOCK_N = 128                 # weight rows per program: one weight-scale row, 16 KB of w_q per K-step
PROGRAMS_PER_SM = 2           # split-K target where cdiv(N, BLOCK_N) < SMs: enough weight bytes in flight per SM
# NOTE: a one-row form on the CUDA cores (each [BN, 128] weight step converted to fp32 in registers, multiplied and
# summed along K, the next step's load issued first, no shared memory) was 0.49-0.67x this kernel's speed at V3's
# shapes under its split rule and 0.62-0.93x at its best tiles (H100, 2026-12-06: benchmarks/results/fp8-gemv1-h100.md):
# the conversions and the sums cost more issue slots than the tensor-core path. Removed (f6126e3, reverted).


class Fp8GemvConfig(NamedTuple):
    block_n: int              # a divisor of GROUP (one weight scale per program and K-step)
    split_k: int              # K ranges (grid axis 1); > 1 writes fp32 partials [S, M, N] summed by `sum_dim1`
    num_warps: int = 4
    num_stages: int = 4       # 3 steps of 16 KB in flight per program


@triton.jit(do_not_specialize=["M"])
def _fp8_gemv_kernel(X, W, WS, B, Y, M, N, K, groups_per_split, stride_xm, stride_wn, stride_wsn, stride_ys,
                     stride_ym, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     INTERPRET: tl.constexpr, PDL: tl.constexpr):
    # Grid (cdiv(N, BLOCK_N), S): program (n, s) computes y rows' columns [n * BN, +BN) over groups [g0, g1) of K.
    # NOTE: tl.dot on [BM, 128] x [128, BN] fp8 tiles (mma.sync with the rows padded to 16; wgmma needs 64): the
    # weights reach the tensor cores through shared memory with one e4m3 -> f16 unpack per two bytes, and the exact
    # products are summed in fp32. An elementwise multiply + tl.sum would convert every weight to fp32 and spend
    # BLOCK_M FMAs per weight byte on the CUDA cores.
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, 128)
    m_ok, n_ok = offs_m < M, offs_n < N
    rn = tl.minimum(offs_n, N - 1).to(tl.int64)        # NOTE: rows past N re-read row N - 1: no load mask
    g0 = pid_k * groups_per_split
    g1 = tl.minimum(g0 + groups_per_split, K // 128)
    w_ptrs = W + rn[None, :] * stride_wn + (g0 * 128 + offs_k)[:, None]               # [128, BN]
    x_ptrs = X + offs_m[:, None] * stride_xm + (g0 * 128 + offs_k)[None, :]           # [BM, 128]
    ws_ptr = WS + (pid_n * BLOCK_N // 128) * stride_wsn + g0                           # this tile's scale row
    # The first step's weights are read before the wait for the previous kernel (PDL: no kernel writes them) and
    # used after the loop, so the loop's own loads are issued without waiting for them.
    w0 = tl.load(w_ptrs)
    ws0 = tl.load(ws_ptr)
    pdl_enter(PDL)
    x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
    x0_q, x0_s = quant_group_rows(x.to(tl.float32), INTERPRET)                        # [BM, 128] e4m3, [BM]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(g0 + 1, g1):
        x_ptrs += 128
        w_ptrs += 128
        ws_ptr += 1
        x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
        x_q, x_s = quant_group_rows(x.to(tl.float32), INTERPRET)
        # one scale group: fp32 sum of exact fp8 products, then both scales (DeepSeek-V3 sec. 3.3.2)
        acc += tl.dot(x_q, tl.load(w_ptrs)) * (x_s * tl.load(ws_ptr))[:, None]
    acc += tl.dot(x0_q, w0) * (x0_s * ws0)[:, None]
    pdl_release(PDL)
    if HAS_BIAS:                                        # once: in split 0's partial
        bias = tl.load(B + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        acc += tl.where(pid_k == 0, bias, 0.0)[None, :]
    y_ptrs = Y + pid_k * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@functools.lru_cache(maxsize=None)
def _cuda_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device | None = None) -> int:
    """SMs of `device` (default: the current CUDA device); 132, the H100's count, off CUDA (the interpreter gets the
    same splits and tiles as the GPU)."""
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    if device.type != "cuda":
        return 132
    return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())


def fp8_gemv_config(n: int, k: int, num_sms: int = 132, block_n: int = BLOCK_N) -> Fp8GemvConfig:
    """Split K only where the block_n tiles of N leave SMs idle, then into about PROGRAMS_PER_SM programs per SM
    of equal group counts (V3 at 132 SMs: 2112 x 7168 -> 14 splits of 4 groups; 7168 x 16384 -> 5 of 26; 4096 x 7168
    -> 8 of 7; 24576 x 1536 and 36864 x 7168 -> 1)."""
    tiles, groups = triton.cdiv(n, block_n), k // GROUP
    split = 1
    if tiles < num_sms:
        split = min(groups, triton.cdiv(PROGRAMS_PER_SM * num_sms, tiles))
        split = triton.cdiv(groups, triton.cdiv(groups, split))        # no empty split
    return Fp8GemvConfig(block_n, split)


def fp8_gemv(x: torch.Tensor, w_q: torch.Tensor, w_scale_inv: torch.Tensor, bias: torch.Tensor | None = None,
             out_dtype: torch.dtype | None = None, block_m: int = FP8_GEMV_MAX_M,
             config: Fp8GemvConfig | None = None) -> torch.Tensor:
    """y [M, N] = quant(x) @ dequant(w_q, w_scale_inv)^T (+ bias), the contract of `fp8_linear_ref` for few rows.

    Args:
        x: [M, K] fp16 / bf16 / fp32, M <= block_m, K a multiple of 128, contiguous along K (any row stride).
        w_q: [N, K] float8_e4m3fn, contiguous along K. w_scale_inv: [ceil(N/128), K/128] float32 (128 x 128 blocks).
        bias: [N] or None, added in fp32 before the one rounding to out_dtype (default x.dtype).
        block_m: rows of the activation tile, a power of two <= 16 (FP8_GEMV_MAX_M: one compile for all M).
        config: default `fp8_gemv_config`.
    Returns:
        [M, N], deterministic (split-K partials are summed in a fixed order).
    """
    _check_args(x, w_q, w_scale_inv, block_m)
    (m, k), n = x.shape, w_q.shape[0]
    out = torch.empty((m, n), dtype=out_dtype or x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    cfg = config or fp8_gemv_config(n, k, num_sms(x.device))
    assert GROUP % cfg.block_n == 0, f"block_n must divide {GROUP}, got {cfg.block_n}"
    groups_per_split = triton.cdiv(k // GROUP, cfg.split_k)
    split = triton.cdiv(k // GROUP, groups_per_split)
    y = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    _fp8_gemv_kernel[(triton.cdiv(n, cfg.block_n), split)](
        x, w_q, w_scale_inv, bias if bias is not None else w_scale_inv, y, m, n, k, groups_per_split,
        x.stride(0), w_q.stride(0), w_scale_inv.stride(0), y.stride(0) if split > 1 else 0, y.stride(-2),
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=cfg.block_n, INTERPRET=not x.is_cuda,
        **pdl_meta(x.device), num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if split > 1:
        sum_dim1(y.view(1, split, m * n), out=out.view(1, m * n))      # [S, M, N] fp32 -> [M, N]
    return out


def _check_args(x: torch.Tensor, w_q: torch.Tensor, w_scale_inv: torch.Tensor, block_m: int) -> None:
    assert x.dim() == 2 and w_q.dim() == 2 and x.shape[1] == w_q.shape[1], \
        f"x [M, K] and w_q [N, K] expected, got {tuple(x.shape)} and {tuple(w_q.shape)}"
    (m, k), n = x.shape, w_q.shape[0]
    assert block_m in (1, 2, 4, 8, 16) and m <= block_m, f"fp8_gemv takes at most {block_m} rows, got {m}"
    assert k > 0 and k % GROUP == 0, f"fp8_gemv needs K a multiple of {GROUP}, got {k}"
    assert x.dtype in (torch.float16, torch.bfloat16, torch.float32), f"x must be fp16/bf16/fp32, got {x.dtype}"
    assert w_q.dtype == torch.float8_e4m3fn, f"w_q must be float8_e4m3fn, got {w_q.dtype}"
    assert x.stride(1) == 1 and w_q.stride(1) == 1, "x and w_q must be contiguous along K"
    gn = triton.cdiv(n, GROUP)
    assert w_scale_inv.shape == (gn, k // GROUP) and w_scale_inv.dtype == torch.float32 \
        and w_scale_inv.stride(1) == 1, (f"w_scale_inv must be float32 [{gn}, {k // GROUP}] contiguous along K, "
                                         f"got {w_scale_inv.dtype} {tuple(w_scale_inv.shape)}")
    assert len({x.device, w_q.device, w_scale_inv.device}) == 1, "x, w_q and w_scale_inv must share a device"
