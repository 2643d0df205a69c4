"""Weight-streaming GEMM for decode batch sizes: y [M, N] = x [M, K] @ W[N, K]^T (+ b) with M <= 16.

At M <= 16 a linear layer is a read of W (N * K values) and nothing else; cuBLAS's kernels for these shapes
reached 1.4-2 TB/s of the H100's 3 TB/s. `gemv`: each program owns BLOCK_N output columns and streams their W rows
along K through a multi-stage pipeline; all M rows ride in one 16-row dot tile.

`gemv1` (one row, the batch-1 decode's projections of a few MB): each program holds its whole [BLOCK_N, K] slice of
W in registers, loaded before the PDL wait, so the weight read overlaps the previous kernel's tail and what is left
after it is one load of x, the row sums and the store. cuBLAS took 6.1 us for each of V2-Lite's 8-15 MB
projections on an H200 (decode-profile-h200.md), where their bytes take 2-3.6 us.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from mlaserve.env import on_off
from mlaserve.kernels.pdl import pdl_enter, pdl_meta, pdl_release
from mlaserve.kernels.precision import dot_precision

MAX_M = 16
# Output widths from which `linear` takes gemv: at M <= 16 on an H100 it beat cuBLAS by 5-8% on lm_head (102400
# and 129280 x 7168) and the dense gate_up, tied on q / o projections (2-4k wide) and lost 20% on the dense
# down_proj (2048 wide, K 10944): benchmarks/bench_decode_gemms.py, benchmarks/results/decode-perf-h100.md.
MIN_N = 7168
TARGET_PROGRAMS = 264        # ~2 per SM (H100): enough W bytes in flight to cover HBM latency
GEMV1_MAX_K = 8192           # gemv1 holds a whole row of W: K up to this
GEMV1_TILE = 16384           # W values one gemv1 program holds (32 KB of bf16: 64 a thread at 8 warps)
_TL_DTYPE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(X, W, B, Y, M, N, K, stride_xm, stride_wn, stride_ym, HAS_BIAS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr,
                 PDL: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok, n_ok = offs_m < M, offs_n < N
    x_rows = X + offs_m[:, None] * stride_xm
    w_rows = W + offs_n.to(tl.int64)[:, None] * stride_wn
    # the first K block of W is read before the wait for the previous kernel (PDL: W is no kernel's output)
    offs_k = tl.arange(0, BLOCK_K)
    k_ok = offs_k < K
    w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)       # [BN, BK]
    pdl_enter(PDL)
    x = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)       # [BM, BK]
    acc = tl.dot(x, tl.trans(w), input_precision=DOT_PREC, out_dtype=tl.float32)
    for k0 in range(BLOCK_K, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        x = tl.load(x_rows + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)   # [BM, BK]
        w = tl.load(w_rows + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)   # [BN, BK]
        acc += tl.dot(x, tl.trans(w), input_precision=DOT_PREC)
    pdl_release(PDL)
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(Y.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _gemv1_kernel(X, W, B, Y, N, K, stride_wn, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    # program: y[n0 : n0 + BLOCK_N] = W[n0 : n0 + BLOCK_N, :] @ x, the whole K in one tile
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok, k_ok = offs_n < N, offs_k < K
    w = tl.load(W + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :],
                other=0.0)                                                               # [BN, BK]: no kernel's output
    pdl_enter(PDL)
    x = tl.load(X + offs_k, mask=k_ok, other=0.0)                                        # [BK]
    acc = tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)                  # [BN] exact products, fp32 sums
    pdl_release(PDL)
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=n_ok, other=0.0).to(tl.float32)
    tl.store(Y + offs_n, acc.to(Y.dtype.element_ty), mask=n_ok)


def gemv1_enabled() -> bool:
    """`linear` takes `gemv1` for one-row inputs (MLASERVE_GEMV1=0: cuBLAS there, for A/B runs)."""
    return on_off("MLASERVE_GEMV1", True)


def gemv1(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [1, K] @ w [N, K]^T (+ bias [N]) -> [1, N] in x.dtype, K <= GEMV1_MAX_K, w contiguous along K."""
    assert x.dim() == 2 and w.dim() == 2 and x.shape[0] == 1 and x.shape[1] == w.shape[1], \
        f"x [1, K] and w [N, K] expected, got {tuple(x.shape)} and {tuple(w.shape)}"
    n, k = w.shape
    assert 0 < k <= GEMV1_MAX_K, f"gemv1 takes K up to {GEMV1_MAX_K}, got {k}"
    assert x.dtype == w.dtype and x.dtype in _TL_DTYPE and x.device == w.device, \
        f"x and w must share a float dtype and device, got {x.dtype} / {w.dtype}"
    assert x.stride(1) == 1 and w.stride(1) == 1, "x and w must be contiguous along K"
    y = x.new_empty((1, n))
    block_k = triton.next_power_of_2(k)
    block_n = max(1, min(64, GEMV1_TILE // block_k, triton.next_power_of_2(n)))
    _gemv1_kernel[(triton.cdiv(n, block_n),)](
        x, w, bias if bias is not None else w, y, n, k, w.stride(0), HAS_BIAS=bias is not None, BLOCK_N=block_n,
        BLOCK_K=block_k, **pdl_meta(x.device), num_warps=8)
    return y


def _block_n(n: int) -> int:
    """Columns per program: the widest of 64 / 32 / 16 that still gives about TARGET_PROGRAMS programs."""
    for b in (64, 32):
        if triton.cdiv(n, b) >= TARGET_PROGRAMS:
            return b
    return 16


def gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] (M <= 16, last dim contiguous) @ w [N, K]^T (+ bias [N]) -> [M, N] in x.dtype."""
    assert x.dim() == 2 and w.dim() == 2 and x.shape[1] == w.shape[1], \
        f"x [M, K] and w [N, K] expected, got {tuple(x.shape)} and {tuple(w.shape)}"
    m, k = x.shape
    n = w.shape[0]
    assert m <= MAX_M, f"gemv takes at most {MAX_M} rows, got {m}"
    assert x.dtype == w.dtype and x.dtype in _TL_DTYPE and x.device == w.device, \
        f"x and w must share a float dtype and device, got {x.dtype} / {w.dtype}"
    assert x.stride(1) == 1 and w.stride(1) == 1, "x and w must be contiguous along K"
    y = x.new_empty((m, n))
    if m == 0:
        return y
    block_n = _block_n(n)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, w, bias if bias is not None else w, y, m, n, k, x.stride(0), w.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=16, BLOCK_N=block_n, BLOCK_K=256 if k >= 256 else 64,
        DOT_PREC=dot_precision(x.dtype), **pdl_meta(x.device), num_warps=4, num_stages=4)
    return y


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through `gemv` for up to MAX_M rows of 16-bit activations on the GPU (decode) and outputs at
    least MIN_N wide, through `gemv1` for one row and narrower outputs (K <= GEMV1_MAX_K), else cuBLAS with the rows
    padded to a bucket (`cublas_linear`)."""
    if x.dim() == 2 and x.shape[0] <= MAX_M and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) \
            and x.stride(1) == 1 and w.stride(1) == 1:
        if w.shape[0] >= MIN_N:
            return gemv(x, w, bias)
        if x.shape[0] == 1 and w.shape[1] <= GEMV1_MAX_K and gemv1_enabled():
            return gemv1(x, w, bias)
    return cublas_linear(x, w, bias)


def bucket_rows(m: int) -> int:
    """`m` rounded up to one of four sizes per power of two (multiples of 16 at least): at most 25% more rows."""
    if m <= MAX_M:
        return m
    step = max(16, (1 << (m - 1).bit_length()) // 8)
    return -(-m // step) * step


def pads_rows(x: torch.Tensor) -> bool:
    """Whether `cublas_linear` pads x's rows to `bucket_rows` by default: eager GPU code, not while a CUDA graph
    captures (its shapes are fixed and replay skips the host) nor under torch.compile (no SymInt arithmetic)."""
    return x.is_cuda and torch.cuda.is_available() and not torch.compiler.is_compiling() \
        and not torch.cuda.is_current_stream_capturing()


def cublas_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *,
                  pad: bool | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """F.linear with a 2-D `x`'s rows padded to `bucket_rows` (zeros; the extra output rows are dropped) in eager
    GPU code. cuBLAS picks its kernel on the host for every new shape: 0.8-2.3 ms a call for a token count it has
    not seen, 25-35 us for one it has (H100, benchmarks/probe_gemm_host.py), and eager prefill brings a new count
    with nearly every prompt. Buckets keep the shapes few. Not while a CUDA graph captures (its shapes are fixed
    and replay skips the host) nor under torch.compile; `pad` forces it either way (tests).
    out_dtype: a wider output than x's (fp32 from bf16 / fp16 operands, on CUDA): the tensor cores' products of
    16-bit operands are exact in fp32 and summed in fp32, so the result is the fp32 GEMM of the upcast operands up to
    summation order (the MoE router's logits), without its fp32-FMA kernel's time (0.3 ms for V3's router at 4096
    tokens, benchmarks/results/prefill-v3-h100.md)."""
    if pad is None:
        pad = pads_rows(x)
    m = x.shape[0] if x.dim() == 2 else 0
    mp = bucket_rows(m) if pad else m
    if mp != m:
        x = F.pad(x, (0, 0, 0, mp - m))
    if out_dtype is None or out_dtype == x.dtype:
        y = F.linear(x, w, bias)
    else:
        assert x.dim() == 2 and x.is_cuda and bias is None, "out_dtype takes a 2-D CUDA x and no bias"
        y = torch.mm(x, w.t(), out_dtype=out_dtype)
    return y if mp == m else y[:m]


def linear_ref(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Reference for `linear` / `gemv`: F.linear."""
    return F.linear(x, w, bias)
