"""Block-scaled FP8 GEMM: y = (x_q * x_scale) @ (w_q * w_scale_inv)^T with fp32 accumulation.

Shapes: x_q [M, K] e4m3 with x_scale [M, ceil(K/128)] (per token per 128 channels),
w_q [N, K] e4m3 with w_scale_inv [ceil(N/128), ceil(K/128)], y [M, N]. Also `fp8_linear` (quantise + GEMM).
"""
from __future__ import annotations

import functools
import json
import logging
import os
from pathlib import Path
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from mlaserve.kernels.fp8_gemv import FP8_GEMV_MAX_M, fp8_gemv, num_sms
from mlaserve.kernels.pdl import pdl_enter, pdl_meta, pdl_release
from mlaserve.kernels.quant import (block_dequant_ref, per_token_group_quant_fp8, per_token_group_quant_fp8_ref,
                                    quant_group_rows)
from mlaserve.kernels.reduce import sum_dim1

logger = logging.getLogger(__name__)


def fp8_gemm_ref(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale_inv: torch.Tensor,
                 out_dtype: torch.dtype = torch.bfloat16, block: tuple[int, int] = (128, 128)) -> torch.Tensor:
    """Reference: dequantise both operands to fp32 and multiply (the spec of `fp8_gemm`)."""
    m, k = x_q.shape
    x = x_q.float() * x_scale.repeat_interleave(block[1], dim=1)[:, :k]
    w = block_dequant_ref(w_q, w_scale_inv, block, torch.float32)
    return (x @ w.t()).to(out_dtype)


# ---------------------------------------------------------------------------------------------------
# Block-scaled GEMM kernel
# ---------------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["M"])   # one compile for every token count
def _fp8_gemm_kernel(
    a_ptr, b_ptr, c_ptr, as_ptr, bs_ptr, M, N, K,
    stride_am, stride_bn, stride_cs, stride_cm, stride_asm, stride_ask, stride_bsn, stride_bsk,
    SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,
    QUANT_A: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr,
):
    # Grid: (tiles of C, SPLIT_K). GROUP_M swizzle: consecutive programs walk GROUP_M row-tiles of one
    # column of C, so the B tiles they share are still in L2. QUANT_A: a is the unquantised activation and
    # each [BM, BK = SCALE_K] tile is quantised in registers (one group per row, as per_token_group_quant_fp8).
    pid, pid_k = tl.program_id(0), tl.program_id(1)
    grid_m, grid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    width = GROUP_M * grid_n
    first_m = (pid // width) * GROUP_M
    group_size = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % group_size
    pid_n = (pid % width) // group_size

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # NOTE: rows / cols past the edge wrap around (loads need no M/N mask); only the store is masked.
    rm = (offs_m % M).to(tl.int64)
    rn = (offs_n % N).to(tl.int64)

    k_tiles = tl.cdiv(K, BLOCK_K)
    tiles_per_split = tl.cdiv(k_tiles, SPLIT_K)
    k_start = pid_k * tiles_per_split
    k_end = tl.minimum(k_start + tiles_per_split, k_tiles)

    a_ptrs = a_ptr + rm[:, None] * stride_am + (k_start * BLOCK_K + offs_k)[None, :]   # [BM, BK]
    b_ptrs = b_ptr + rn[None, :] * stride_bn + (k_start * BLOCK_K + offs_k)[:, None]   # [BK, BN]
    as_ptrs = as_ptr + rm * stride_asm                                                 # [BM]
    if SCALE_N % BLOCK_N == 0:
        bs_ptrs = bs_ptr + (pid_n * BLOCK_N // SCALE_N) * stride_bsn                   # one scale row
    else:
        bs_ptrs = bs_ptr + (rn // SCALE_N) * stride_bsn                                # [BN]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    pdl_enter(PDL)
    for kt in range(k_start, k_end):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - kt * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        ks = (kt * BLOCK_K) // SCALE_K
        if QUANT_A:
            a, a_s = quant_group_rows(a.to(tl.float32), INTERPRET)
        else:
            a_s = tl.load(as_ptrs + ks * stride_ask)
        b_s = tl.load(bs_ptrs + ks * stride_bsk)
        # Promote each K-block's fp8 product to fp32 with both scales (DeepSeek-V3 sec. 3.3.2).
        if SCALE_N % BLOCK_N == 0:
            acc += tl.dot(a, b) * (a_s * b_s)[:, None]
        else:
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    pdl_release(PDL)

    c_ptrs = c_ptr + pid_k * stride_cs + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask)


def fp8_gemm(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale_inv: torch.Tensor,
             out_dtype: torch.dtype = torch.bfloat16, block: tuple[int, int] = (128, 128),
             config: dict | None = None) -> torch.Tensor:
    """y [M, N] = (x_q * x_scale) @ (w_q * w_scale_inv)^T, fp32 accumulation (contract of `fp8_gemm_ref`).

    Args:
        x_q: [M, K] float8_e4m3fn, K contiguous. x_scale: [M, ceil(K/block[1])] float32.
        w_q: [N, K] float8_e4m3fn, K contiguous. w_scale_inv: [ceil(N/block[0]), ceil(K/block[1])] float32.
        config: BLOCK_M/N/K, GROUP_M, SPLIT_K, num_warps, num_stages; default `get_fp8_gemm_config`.
            BLOCK_K must divide block[1] so one weight scale applies per K-step.
    """
    _check_gemm_args(x_q, x_scale, w_q, w_scale_inv, block)
    (m, k), n = x_q.shape, w_q.shape[0]
    cfg = dict(config) if config is not None else get_fp8_gemm_config(n, k, m)
    assert block[1] % cfg["BLOCK_K"] == 0, f"BLOCK_K={cfg['BLOCK_K']} must divide the scale block {block[1]}"
    return _launch(x_q, x_scale, w_q, w_scale_inv, out_dtype, block, cfg, quant_a=False)


def _launch(a: torch.Tensor, a_scale: torch.Tensor, w_q: torch.Tensor, w_scale_inv: torch.Tensor,
            out_dtype: torch.dtype, block: tuple[int, int], cfg: dict, quant_a: bool) -> torch.Tensor:
    # a: [M, K] e4m3 with a_scale [M, G], or (quant_a) the unquantised activation (a_scale unused)
    (m, k), n = a.shape, w_q.shape[0]
    split = cfg.get("SPLIT_K", 1)
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    c = out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=a.device)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]), split)
    _fp8_gemm_kernel[grid](
        a, w_q, c, a_scale, w_scale_inv, m, n, k,
        a.stride(0), w_q.stride(0), c.stride(0) if split > 1 else 0, c.stride(-2),
        a_scale.stride(0), a_scale.stride(1), w_scale_inv.stride(0), w_scale_inv.stride(1),
        SCALE_N=block[0], SCALE_K=block[1], BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"],
        BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg.get("GROUP_M", 1), SPLIT_K=split,
        EVEN_K=k % cfg["BLOCK_K"] == 0, QUANT_A=quant_a, INTERPRET=not a.is_cuda, **pdl_meta(a.device),
        num_warps=cfg.get("num_warps", 4), num_stages=cfg.get("num_stages", 3),
    )
    if split > 1:
        sum_dim1(c.view(1, split, m * n), out=out.view(1, m * n))        # [S, M, N] fp32 -> [M, N]
    return out


def _check_gemm_args(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale_inv: torch.Tensor,
                     block: tuple[int, int]) -> None:
    assert x_q.dim() == 2, f"x_q must be [M, K], got {tuple(x_q.shape)}"
    assert x_q.dtype == torch.float8_e4m3fn, f"x_q, w_q must be float8_e4m3fn, got {x_q.dtype}, {w_q.dtype}"
    (m, k) = x_q.shape
    assert x_q.stride(1) == 1, "x_q and w_q must be contiguous along K"
    _check_weight(w_q, w_scale_inv, k, block)
    gk = -(-k // block[1])
    assert x_scale.shape == (m, gk) and x_scale.dtype == torch.float32, (
        f"x_scale must be float32 [{m}, {gk}], got {x_scale.dtype} {tuple(x_scale.shape)}")
    devices = {t.device for t in (x_q, x_scale, w_q, w_scale_inv)}
    assert len(devices) == 1, f"all operands must be on one device, got {devices}"


def _check_weight(w_q: torch.Tensor, w_scale_inv: torch.Tensor, k: int, block: tuple[int, int]) -> None:
    assert w_q.dim() == 2, f"w_q must be [N, K], got {tuple(w_q.shape)}"
    assert w_q.dtype == torch.float8_e4m3fn, f"x_q, w_q must be float8_e4m3fn, got {w_q.dtype}"
    n, kw = w_q.shape
    assert k == kw, f"K mismatch: x_q has {k}, w_q has {kw}"
    assert w_q.stride(1) == 1, "x_q and w_q must be contiguous along K"
    gk, gn = -(-k // block[1]), -(-n // block[0])
    assert w_scale_inv.shape == (gn, gk) and w_scale_inv.dtype == torch.float32, (
        f"w_scale_inv must be float32 [{gn}, {gk}], got {w_scale_inv.dtype} {tuple(w_scale_inv.shape)}")


# ---------------------------------------------------------------------------------------------------
# Tuned configs: configs/N=..,K=..,device_name=..,dtype=fp8_w8a8,block_shape=[128, 128].json
# holding {"<M>": {BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, SPLIT_K, num_warps, num_stages}, ...}
# ---------------------------------------------------------------------------------------------------

CONFIG_DIR = Path(__file__).parent / "configs"


def config_file_name(n: int, k: int, device_name: str) -> str:
    return f"N={n},K={k},device_name={device_name},dtype=fp8_w8a8,block_shape=[128, 128].json"


@functools.lru_cache(maxsize=None)
def current_device_name() -> str:
    return torch.cuda.get_device_name().replace(" ", "_") if torch.cuda.is_available() else "cpu"


@functools.lru_cache(maxsize=None)
def _load_configs(config_dir: str, n: int, k: int, device_name: str) -> dict[int, dict] | None:
    path = Path(config_dir) / config_file_name(n, k, device_name)
    if not path.is_file():
        logger.warning("fp8_gemm: no tuned config %s; using defaults (tune: python -m "
                       "mlaserve.tools.tune_fp8_gemm --shapes %d,%d)", path.name, n, k)
        return None
    with open(path) as f:
        return {int(m): cfg for m, cfg in json.load(f).items()}


def default_fp8_gemm_config(n: int, k: int, m: int, num_sms: int = 132) -> dict:
    """Untuned choice: skinny tiles + split-K for decode (fill the SMs), 128x128x128 for prefill."""
    if m <= 64:
        block_m = max(16, triton.next_power_of_2(m))
        tiles = triton.cdiv(m, block_m) * triton.cdiv(n, 64)
        split, k_tiles = 1, triton.cdiv(k, 128)
        while tiles * split < num_sms and k_tiles // (2 * split) >= 2:
            split *= 2
        return dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, SPLIT_K=split, num_warps=4, num_stages=4)
    if m <= 256:
        return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, SPLIT_K=1, num_warps=4, num_stages=3)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=128, GROUP_M=8, SPLIT_K=1, num_warps=8, num_stages=3)


def get_fp8_gemm_config(N: int, K: int, M: int, device_name: str | None = None) -> dict:
    """Kernel config for an [M, K] x [N, K]^T GEMM: the tuned entry of the nearest M, else a default."""
    configs = _load_configs(str(CONFIG_DIR), N, K, device_name or current_device_name())
    if not configs:
        return default_fp8_gemm_config(N, K, M, num_sms())
    return dict(configs[min(configs, key=lambda mm: (abs(mm - M), mm))])


# ---------------------------------------------------------------------------------------------------
# Linear layer entry point: dynamic per-token-group activation quantisation + block GEMM
# ---------------------------------------------------------------------------------------------------

def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


# Up to this many rows fp8_linear quantises the activations inside the GEMM (one launch); above it the separate
# per_token_group_quant_fp8 pass (every N tile would otherwise re-quantise the same rows). Measured by
# benchmarks/gpu_moe_fuse.sh (fp8 part) on an H100, the six V3 shapes: 4 us faster in all at M = 1 and 25 us at
# M = 16 (some shapes lose 1-4 us, most win), 2-4x slower at 64.
FUSE_QUANT_MAX_M = 16

# From this many rows fp8_linear runs cuBLAS's block-scaled FP8 matmul (1x128 activation and 128x128 weight scales,
# DeepSeek-V3's recipe) where `cublas_block_fp8_ok` holds. benchmarks/probe_fp8_cublas.py on an H100 (the eight V3
# shapes, prefill-v3-h100.md), fp8_linear whole: cuBLAS 0.70-0.98x of the Triton path's speed at M = 64, 1.02-1.71x
# at 128, 1.13-1.77x at 512, 1.2-1.55x at 1024; the GEMM alone 1.4-1.7x at 2048 and 4096; the same error.
CUBLAS_BLOCK_FP8_MIN_M = 128


@functools.lru_cache(maxsize=None)
def cublas_block_fp8_available(device_index: int) -> bool:
    """Whether this torch and GPU have cuBLAS's block-scaled FP8 matmul: torch's `scaled_mm` with BlockWise1x128 /
    BlockWise128x128 recipes, CUDA >= 12.9, compute capability 9.0 (cuBLAS has these scale modes on Hopper only)."""
    cuda = tuple(int(p) for p in (torch.version.cuda or "0.0").split(".")[:2])
    recipes = getattr(torch.nn.functional, "ScalingType", None)
    return (cuda >= (12, 9) and recipes is not None and hasattr(recipes, "BlockWise1x128")
            and hasattr(torch.nn.functional, "scaled_mm") and torch.cuda.get_device_capability(device_index) == (9, 0))


def cublas_block_fp8_ok(x2: torch.Tensor, w_q: torch.Tensor) -> bool:
    """Whether fp8_linear's [M, K] x [N, K]^T may go to cuBLAS: a CUDA tensor of at least CUBLAS_BLOCK_FP8_MIN_M rows,
    K a multiple of 512 (whole 128-channel groups, their count a multiple of 4 as cuBLAS's scale layout wants), N a
    multiple of 16, both operands K-contiguous, on a GPU with the feature."""
    return _cublas_ok(*x2.shape, w_q, x2.is_cuda, x2.stride(1) == 1)


def _cublas_ok(m: int, k: int, w_q: torch.Tensor, on_gpu: bool, contiguous: bool) -> bool:
    return (on_gpu and m >= CUBLAS_BLOCK_FP8_MIN_M and k % 512 == 0 and w_q.shape[0] % 16 == 0 and contiguous
            and w_q.stride(1) == 1 and cublas_block_fp8_available(w_q.device.index or 0))


def cublas_rows(m: int) -> int:
    """Rows the cuBLAS path runs for M tokens: M rounded up to a multiple of 4 (cuBLAS refuses other counts of M-major
    scales). Not bucketed as `cublas_linear`'s bf16 rows are: a token count cuBLASLt has not seen costs this path
    20-130 us more host time once, not bf16's 0.8-2.3 ms (benchmarks/probe_fp8_cublas.py --host, H100), and padded
    rows cost GPU time at prefill sizes."""
    return -(-m // 4) * 4


def cublas_block_fp8(x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale_inv: torch.Tensor,
                     out_dtype: torch.dtype) -> torch.Tensor:
    """y [M, N] = (x_q * x_scale) @ (w_q * w_scale_inv)^T through cuBLAS (contract of `fp8_gemm_ref`).

    x_scale [M, K/128] M-major with M a multiple of 4 (`per_token_group_quant_fp8(..., scale_m_major=True,
    out_rows=cublas_rows(m))`: cuBLAS refuses other row counts); w_scale_inv [ceil(N/128), K/128] as checkpoints
    store it (its transpose is the K-major [K/128, N/128] cuBLAS reads: a view)."""
    f = torch.nn.functional
    return f.scaled_mm(x_q, w_q.t(), x_scale, f.ScalingType.BlockWise1x128, w_scale_inv.t(),
                       f.ScalingType.BlockWise128x128, output_dtype=out_dtype)


class QuantPlan(NamedTuple):
    """The activation layout of fp8_linear's separate quantisation pass, which a producer that quantises its own
    output for the linear (`norm.rmsnorm_quant_fp8`, `activation.silu_and_mul_quant_fp8`) must write."""
    scale_m_major: bool    # cuBLAS's block-scaled matmul (M-major scales) rather than the Triton GEMM (row-major)
    rows: int              # rows of codes and scales: cublas_rows(M) for cuBLAS, else M


def _dispatch(m: int, k: int, w_q: torch.Tensor, on_gpu: bool, contiguous: bool, gemv: bool | None,
              fuse_quant: bool | None, cublas: bool | None) -> tuple[str, dict | None]:
    # fp8_linear's path for an [M, K] input: "gemv", "cublas", "fused" (the GEMM quantises x) or "separate" (the
    # quantisation pass, then the GEMM), with the GEMM's tile config
    if gemv is None:
        gemv = m <= FP8_GEMV_MAX_M and k % 128 == 0 and k > 0 and contiguous
    if gemv:
        return "gemv", None
    if cublas is None:
        cublas = _cublas_ok(m, k, w_q, on_gpu, contiguous)
    if cublas:
        return "cublas", None
    cfg = get_fp8_gemm_config(w_q.shape[0], k, m)
    if fuse_quant is None:
        fuse_quant = m <= FUSE_QUANT_MAX_M
    return ("fused" if fuse_quant and cfg["BLOCK_K"] == 128 and contiguous else "separate"), cfg


def quant_plan(m: int, x: torch.Tensor, w_q: torch.Tensor) -> QuantPlan | None:
    """How `fp8_linear` would quantise a contiguous [m, K] input on x's device for w_q in a pass of its own, or None
    where it runs none (the gemv and the small GEMM quantise inside; plain CPU runs the reference)."""
    if not _use_triton(x):
        return None
    return _plan(_dispatch(m, w_q.shape[1], w_q, x.is_cuda, True, None, None, None)[0], m)


def _plan(path: str, m: int) -> QuantPlan | None:
    # the separate pass's layout on `_dispatch`'s path for m rows (None: no separate pass)
    if path == "cublas":
        return QuantPlan(True, cublas_rows(m))
    return QuantPlan(False, m) if path == "separate" else None


def fp8_linear(x: torch.Tensor, w_q: torch.Tensor, w_scale_inv: torch.Tensor, bias: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None, fuse_quant: bool | None = None,
               gemv: bool | None = None, cublas: bool | None = None) -> torch.Tensor:
    """y [..., N] = x [..., K] @ dequant(w_q, w_scale_inv)^T (+ bias), x quantised per token per 128 channels.

    Triton on CUDA (and under TRITON_INTERPRET=1); `fp8_linear_ref` on plain CPU. Output dtype: out_dtype or x.dtype.
    gemv: through the weight-streaming `fp8_gemv` (x quantised inside it); default for M <= FP8_GEMV_MAX_M rows with
    K a multiple of 128. True forces it for up to 16 rows, False forces the GEMM below (benchmarks, tests).
    fuse_quant (GEMM path): quantise x inside the GEMM (bit-identical codes and scales to `per_token_group_quant_fp8`);
    default for M <= FUSE_QUANT_MAX_M when the tile config's BLOCK_K is the 128-channel group.
    cublas: through cuBLAS's block-scaled FP8 matmul (`cublas_block_fp8`); default where `cublas_block_fp8_ok`
    holds. True forces it (an error where the GPU or torch lacks it), False forces the Triton GEMM.
    """
    if not _use_triton(x):
        return fp8_linear_ref(x, w_q, w_scale_inv, bias, out_dtype)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)                                                # [M, K]
    m, n = x2.shape[0], w_q.shape[0]
    path, cfg = _dispatch(m, k, w_q, x2.is_cuda, x2.stride(1) == 1, gemv, fuse_quant, cublas)
    if path == "gemv":
        block_m = max(FP8_GEMV_MAX_M, triton.next_power_of_2(m))
        return fp8_gemv(x2, w_q, w_scale_inv, bias, out_dtype or x.dtype, block_m=block_m).view(*lead, n)
    if path != "fused":                                   # fp8_linear_quantized checks the weight
        plan = _plan(path, m)
        x_q, x_scale = per_token_group_quant_fp8(x2, 128, scale_m_major=plan.scale_m_major, out_rows=plan.rows)
        return fp8_linear_quantized(x_q, x_scale, m, plan, w_q, w_scale_inv, bias, out_dtype or x.dtype,
                                    cfg).view(*lead, n)
    _check_weight(w_q, w_scale_inv, k, (128, 128))
    y = _launch(x2, x2, w_q, w_scale_inv, out_dtype or x.dtype, (128, 128), cfg, quant_a=True)
    if bias is not None:
        y += bias
    return y.view(*lead, n)


def fp8_linear_quantized(x_q: torch.Tensor, x_scale: torch.Tensor, m: int, plan: QuantPlan, w_q: torch.Tensor,
                         w_scale_inv: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype,
                         config: dict | None = None) -> torch.Tensor:
    """y [m, N] of `fp8_linear` from an input already quantised as `plan` (`quant_plan`) says: x_q [plan.rows, K]
    e4m3 with x_scale [plan.rows, K/128], M-major for cuBLAS's matmul (rows past m dropped), row-major for the
    Triton GEMM."""
    k = w_q.shape[1]
    assert x_q.shape == (plan.rows, k) and x_scale.shape[0] == plan.rows and plan.rows >= m, \
        f"x_q {tuple(x_q.shape)} / x_scale {tuple(x_scale.shape)} do not fit {plan} for {m} rows of K = {k}"
    _check_weight(w_q, w_scale_inv, k, (128, 128))
    if plan.scale_m_major:
        y = cublas_block_fp8(x_q, x_scale, w_q, w_scale_inv, out_dtype)[:m]
    else:
        y = fp8_gemm(x_q, x_scale, w_q, w_scale_inv, out_dtype=out_dtype,
                     config=config or get_fp8_gemm_config(w_q.shape[0], k, m))
    if bias is not None:
        y += bias
    return y


def fp8_linear_ref(x: torch.Tensor, w_q: torch.Tensor, w_scale_inv: torch.Tensor, bias: torch.Tensor | None = None,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Reference of `fp8_linear` through `per_token_group_quant_fp8_ref` and `fp8_gemm_ref` (fp32 until the end)."""
    lead, k = x.shape[:-1], x.shape[-1]
    x_q, x_scale = per_token_group_quant_fp8_ref(x.reshape(-1, k), 128)
    y = fp8_gemm_ref(x_q, x_scale, w_q, w_scale_inv, out_dtype=torch.float32)
    if bias is not None:
        y = y + bias.float()
    return y.to(out_dtype or x.dtype).view(*lead, w_q.shape[0])
