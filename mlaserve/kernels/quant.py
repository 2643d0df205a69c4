"""FP8 quantisation: per-token-group activations (group 128, scale = amax / 448) and 128x128 weight blocks.

Shapes: `M` rows (tokens), `K` channels, `G = ceil(K / group)` groups, `N` weight rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from mlaserve.kernels.pdl import pdl_enter, pdl_meta

FP8_E4M3_MAX = 448.0
FP8_E5M2_MAX = 57344.0
FP8_MIN_SCALE = 1e-10


def fp8_max(dtype: torch.dtype) -> float:
    return FP8_E5M2_MAX if dtype == torch.float8_e5m2 else FP8_E4M3_MAX


def per_token_group_quant_fp8_ref(x: torch.Tensor, group: int = 128,
                                  dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise activations per token per `group` channels.

    Args:
        x: [M, K] (any float dtype). K need not be a multiple of `group`.
    Returns:
        (x_q [M, K] fp8, scale [M, G] float32) with x ~= x_q * scale per group.
    """
    m, k = x.shape
    g = -(-k // group)
    xp = torch.nn.functional.pad(x.float(), (0, g * group - k)).view(m, g, group)
    amax = xp.abs().amax(dim=-1).clamp_min(FP8_MIN_SCALE)       # [M, G]
    scale = amax / torch.full_like(amax, fp8_max(dtype))   # NOTE: tensor / tensor: exact on CUDA too
    xq = (xp / scale[..., None]).clamp(-fp8_max(dtype), fp8_max(dtype)).to(dtype)
    return xq.view(m, g * group)[:, :k].contiguous(), scale


def block_quant_fp8_ref(w: torch.Tensor, block: tuple[int, int] = (128, 128),
                        dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise a weight [N, K] in `block` tiles: returns (w_q [N, K] fp8, scale_inv [ceil(N/bn), ceil(K/bk)] fp32).

    `scale_inv` is the DeepSeek-V3 checkpoint's `weight_scale_inv`: w ~= w_q * scale_inv (per block).
    """
    n, k = w.shape
    bn, bk = block
    gn, gk = -(-n // bn), -(-k // bk)
    wp = torch.nn.functional.pad(w.float(), (0, gk * bk - k, 0, gn * bn - n))
    tiles = wp.view(gn, bn, gk, bk)
    amax = tiles.abs().amax(dim=(1, 3)).clamp_min(FP8_MIN_SCALE)   # [gn, gk]
    scale_inv = amax / torch.full_like(amax, fp8_max(dtype))
    wq = (tiles / scale_inv[:, None, :, None]).clamp(-fp8_max(dtype), fp8_max(dtype)).to(dtype)
    return wq.view(gn * bn, gk * bk)[:n, :k].contiguous(), scale_inv


def block_dequant_ref(w_q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128),
                      dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Inverse of `block_quant_fp8_ref`: w [N, K] = w_q * scale_inv expanded over its blocks."""
    n, k = w_q.shape
    bn, bk = block
    s = scale_inv.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    return (w_q.float() * s).to(dtype)


# (mantissa bits, smallest normal exponent) of each fp8 format, for the interpreter's software rounding.
_FP8_GRID = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}


@triton.jit
def round_to_fp8_grid(v, MANT: tl.constexpr, MIN_EXP: tl.constexpr):
    """Round fp32 `v` to the nearest (ties to even) value of an fp8 grid, returned as fp32.

    NOTE: only for the CPU interpreter, whose fp32 -> fp8 cast truncates and drops mantissa carries;
    on GPU the cast itself rounds to nearest even. Assumes |v| is already clamped to the format's max.
    """
    e = (v.to(tl.int32, bitcast=True) >> 23) & 0xFF                  # biased exponent of v
    e = tl.maximum(e, MIN_EXP + 127)                                 # subnormals share the smallest step
    step = ((e - MANT) << 23).to(tl.float32, bitcast=True)          # 2^(exp - MANT): the grid spacing
    r = ((tl.abs(v) / step + 12582912.0) - 12582912.0) * step        # 1.5 * 2^23: fp32 add rounds to int
    return tl.where(v < 0, -r, r)                                    # keeps -0.0 as the GPU cast does


@triton.jit
def quant_group_rows(a, INTERPRET: tl.constexpr):
    """a: [BM, GROUP] fp32, one e4m3 quantisation group per row -> (a_q [BM, GROUP] e4m3, scale [BM] = amax / 448).

    For GEMMs that quantise their activation tile in registers: the same operations and roundings as
    `_per_token_group_quant_fp8_kernel` (bit-identical codes and scales), for tiles of exactly one group.
    """
    scale = tl.maximum(tl.max(tl.abs(a), axis=1), 1e-10)                       # FP8_MIN_SCALE
    scale = tl.math.div_rn(scale, tl.full(scale.shape, 448.0, tl.float32))    # FP8_E4M3_MAX
    q = tl.minimum(tl.maximum(tl.math.div_rn(a, scale[:, None]), -448.0), 448.0)
    if INTERPRET:
        q = round_to_fp8_grid(q, 3, -6)   # e4m3: 3 mantissa bits, min exponent -6
    return q.to(tl.float8e4nv), scale


@triton.jit(do_not_specialize=["M"])
def _per_token_group_quant_fp8_kernel(
    x_ptr, xq_ptr, scale_ptr, M, M_OUT, K, G, stride_xm, stride_xk, stride_sm, stride_sg,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_M: tl.constexpr, GROUPS_PER_PROG: tl.constexpr,
    FP8_MAX: tl.constexpr, MIN_SCALE: tl.constexpr, MANT: tl.constexpr, MIN_EXP: tl.constexpr,
    INTERPRETED: tl.constexpr, PDL: tl.constexpr,
):
    # One program: BLOCK_M rows x GROUPS_PER_PROG groups; each group is a [BLOCK_M, BLOCK_G] tile. Rows M..M_OUT
    # (padding) read as zeros: codes 0, the scale of an all-zero group.
    pdl_enter(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_G)
    row_in = rows < M
    row_ok = rows < M_OUT
    rows = rows.to(tl.int64)
    for i in tl.static_range(GROUPS_PER_PROG):
        g = tl.program_id(1) * GROUPS_PER_PROG + i
        k = g * GROUP + cols                                                  # [BLOCK_G]
        mask = row_ok[:, None] & ((cols < GROUP) & (k < K))[None, :]          # [BLOCK_M, BLOCK_G]
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :] * stride_xk, mask=mask & row_in[:, None],
                    other=0.0)
        x = x.to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(x), axis=1), MIN_SCALE)
        # NOTE: correctly rounded divisions, as torch's tensor / tensor (the reference) on every device
        scale = tl.math.div_rn(amax, tl.full(amax.shape, FP8_MAX, tl.float32))         # [BLOCK_M]
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape)), -FP8_MAX), FP8_MAX)
        if INTERPRETED:
            q = round_to_fp8_grid(q, MANT, MIN_EXP)
        tl.store(xq_ptr + rows[:, None] * K + k[None, :], q.to(xq_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + rows * stride_sm + g * stride_sg, scale, mask=row_ok & (rows * 0 + g < G))


def _quant_launch_shape(m: int, g: int, block_g: int) -> tuple[int, int]:
    """(BLOCK_M, GROUPS_PER_PROG): ~2K elements per tile, up to 8 groups per program."""
    block_m = min(triton.next_power_of_2(max(m, 1)), max(1, 2048 // block_g))
    return block_m, min(g, 8)


def quant_outputs(x: torch.Tensor, group: int, scale_m_major: bool, out_rows: int | None,
                  dtype: torch.dtype = torch.float8_e4m3fn) -> tuple[torch.Tensor, torch.Tensor]:
    """Empty (codes [Mp, D] `dtype`, scale [Mp, G] float32, contiguous or M-major) for x [T, D] quantised per
    `group` channels: the layouts of `per_token_group_quant_fp8` (Mp = out_rows, default T)."""
    t, d = x.shape
    m = t if out_rows is None else out_rows
    assert m >= t, f"out_rows must be at least the {t} rows of x, got {out_rows}"
    g = -(-d // group)
    x_q = torch.empty((m, d), dtype=dtype, device=x.device)
    if scale_m_major:
        return x_q, torch.empty((g, m), dtype=torch.float32, device=x.device).t()
    return x_q, torch.empty((m, g), dtype=torch.float32, device=x.device)


def per_token_group_quant_fp8(x: torch.Tensor, group: int = 128, dtype: torch.dtype = torch.float8_e4m3fn,
                              scale_m_major: bool = False,
                              out_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `per_token_group_quant_fp8_ref` (same contract and rounding).

    Args:
        x: [M, K] float (any strides). K need not be a multiple of `group`; any `group` >= 1.
        scale_m_major: store the scale M-major (strides (1, M)), the layout cuBLAS's block-scaled FP8 matmul reads.
        out_rows: rows of the outputs, Mp >= M (default M), the extra ones quantised zeros (codes 0, the scale of an
            all-zero group): cuBLAS wants M-major scales of a row count divisible by 4.
    Returns:
        (x_q [Mp, K] `dtype`, contiguous; scale [Mp, G] float32, contiguous or M-major) with x ~= x_q * scale.
    """
    assert x.dim() == 2, f"x must be [M, K], got shape {tuple(x.shape)}"
    assert x.is_floating_point() and x.element_size() >= 2, f"x must be fp16/bf16/fp32, got {x.dtype}"
    assert dtype in _FP8_GRID, f"dtype must be float8_e4m3fn or float8_e5m2, got {dtype}"
    assert group >= 1, f"group must be >= 1, got {group}"
    m_in, k = x.shape
    x_q, scale = quant_outputs(x, group, scale_m_major, out_rows, dtype)
    m, g = scale.shape
    if m == 0 or k == 0:
        return x_q, scale
    block_g = triton.next_power_of_2(group)
    block_m, groups_per_prog = _quant_launch_shape(m, g, block_g)
    grid = (triton.cdiv(m, block_m), triton.cdiv(g, groups_per_prog))
    mant, min_exp = _FP8_GRID[dtype]
    _per_token_group_quant_fp8_kernel[grid](
        x, x_q, scale, m_in, m, k, g, x.stride(0), x.stride(1), scale.stride(0), scale.stride(1),
        GROUP=group, BLOCK_G=block_g, BLOCK_M=block_m, GROUPS_PER_PROG=groups_per_prog,
        FP8_MAX=fp8_max(dtype), MIN_SCALE=FP8_MIN_SCALE, MANT=mant, MIN_EXP=min_exp,
        INTERPRETED=not x.is_cuda, **pdl_meta(x.device), num_warps=4,
    )
    return x_q, scale
