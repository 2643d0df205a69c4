"""DeepSeek RMSNorm, optionally fused with the residual add and/or per-token-group fp8 quantisation.

One launch, one program per token row. Shapes: `T` tokens, `D` hidden size, `G = ceil(D / group)` groups.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mlaserve.kernels.kv_store import fp8_consts, num_warps_for, store_row_maybe_fp8
from mlaserve.kernels.pdl import pdl_enter, pdl_meta
from mlaserve.kernels.quant import FP8_MIN_SCALE, per_token_group_quant_fp8_ref, quant_outputs

_TILE = 128   # channels per tile row when not quantising (any power of two works)


@triton.jit(do_not_specialize=["T"])
def _rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, scale_ptr, T, D, eps,
                    stride_x, stride_res, stride_out, stride_scale, stride_scale_g,
                    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HAS_RESIDUAL: tl.constexpr, QUANT: tl.constexpr,
                    IS_FP8: tl.constexpr, FP8_MAX: tl.constexpr, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr,
                    SOFT_ROUND: tl.constexpr, MIN_SCALE: tl.constexpr, PDL: tl.constexpr):
    # The row is one [BLOCK_G, GROUP] tile; channel = g * GROUP + c. Rows T.. of the grid (padding of a quantised
    # output) read as zeros: codes 0, the scale of an all-zero group.
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    g = tl.arange(0, BLOCK_G)
    offs = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]                  # [BG, GROUP]
    mask = offs < D
    row_mask = mask & (offs * 0 + row < T)
    x = tl.load(x_ptr + row * stride_x + offs, mask=row_mask, other=0.0)
    in_ty = x.dtype
    x = x.to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + offs, mask=row_mask, other=0.0).to(tl.float32)
        x = (x + r).to(in_ty)                                                 # residual_out, rounded to x.dtype
        tl.store(res_ptr + row * stride_res + offs, x, mask=row_mask)
        x = x.to(tl.float32)
    var = tl.sum(tl.sum(x * x, axis=1), axis=0) / D
    y = (x * tl.math.rsqrt(var + eps)).to(in_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = (w * y).to(in_ty)                                                     # out in x.dtype
    store_row_maybe_fp8(y, out_ptr + row * stride_out, scale_ptr + row * stride_scale, offs, mask, g, D, QUANT,
                        FP8_MAX, MANT_BITS, MIN_EXP, SOFT_ROUND, MIN_SCALE, GROUP, stride_scale_g)


def _check(x: torch.Tensor, weight: torch.Tensor, name: str = "x") -> None:
    assert x.dim() == 2, f"{name} must be [T, D], got {tuple(x.shape)}"
    assert x.stride(1) == 1, f"{name} last dim must be contiguous, strides {x.stride()}"
    assert x.dtype in (torch.bfloat16, torch.float16, torch.float32), f"{name} must be bf16/fp16/fp32, got {x.dtype}"
    assert weight.shape == (x.shape[1],), f"weight must be [{x.shape[1]}], got {tuple(weight.shape)}"
    assert weight.is_contiguous() and weight.is_floating_point(), "weight must be a contiguous float tensor"
    assert weight.device == x.device, f"weight on {weight.device}, {name} on {x.device}"


def check_norm_operands(x: torch.Tensor, norm_weight: torch.Tensor, residual: torch.Tensor | None = None) -> None:
    """The operands of a norm fused into another kernel: norm_weight a contiguous [D] on x's device (x [T, D]);
    `residual`, when added before the norm, of x's shape and dtype with contiguous rows."""
    d = x.shape[-1]
    assert norm_weight.shape == (d,) and norm_weight.is_contiguous() and norm_weight.device == x.device, \
        f"norm_weight must be a contiguous [{d}] tensor on {x.device}, got {tuple(norm_weight.shape)} on " \
        f"{norm_weight.device}"
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype and residual.stride(-1) == 1, \
            f"residual must be {tuple(x.shape)} {x.dtype} with contiguous rows like x, got {tuple(residual.shape)} " \
            f"{residual.dtype} strides {residual.stride()}"


def _launch(x: torch.Tensor, res: torch.Tensor | None, weight: torch.Tensor, out: torch.Tensor,
            scale: torch.Tensor | None, eps: float, group: int) -> None:
    # out: [Mp, D], Mp >= T (rows past T: padding, quantised outputs only)
    t, d = x.shape
    if out.shape[0] == 0:
        return
    block_g = triton.next_power_of_2(triton.cdiv(d, group))
    _rmsnorm_kernel[(out.shape[0],)](
        x, res if res is not None else x, weight, out, scale if scale is not None else out, t, d, float(eps),
        x.stride(0), res.stride(0) if res is not None else 0, out.stride(0),
        scale.stride(0) if scale is not None else 0, scale.stride(1) if scale is not None else 0,
        GROUP=group, BLOCK_G=block_g, HAS_RESIDUAL=res is not None, QUANT=scale is not None,
        **fp8_consts(out.dtype, out.device), MIN_SCALE=FP8_MIN_SCALE, **pdl_meta(x.device),
        num_warps=num_warps_for(block_g * group))


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row of x [T, D] (rows may be strided, last dim contiguous): returns a new [T, D] in x.dtype."""
    _check(x, weight)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, None, weight, out, None, eps, _TILE)
    return out


def fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """residual_out = x + residual; out = rmsnorm(residual_out). Returns (out, residual_out).

    NOTE: `residual` is updated IN PLACE (the returned residual_out is `residual` itself); `x` is left as is
    and `out` is a new tensor. x and residual: [T, D], same dtype, rows may be strided.
    """
    _check(x, weight)
    _check(residual, weight, "residual")
    assert residual.shape == x.shape and residual.dtype == x.dtype, \
        f"residual must match x: {tuple(residual.shape)} {residual.dtype} vs {tuple(x.shape)} {x.dtype}"
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, residual, weight, out, None, eps, _TILE)
    return out, residual


def rmsnorm_quant_fp8(x: torch.Tensor, weight: torch.Tensor, eps: float, group: int = 128,
                      residual: torch.Tensor | None = None, scale_m_major: bool = False,
                      out_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """rmsnorm(x) (rounded to x.dtype) quantised per token per `group` channels to fp8 e4m3; with `residual`,
    rmsnorm(x + residual) and `residual` updated IN PLACE to x + residual (as `fused_add_rmsnorm`).

    Returns (x_q [Mp, D] e4m3, scale [Mp, ceil(D / group)] float32), x_q * scale ~= rmsnorm(x) per group: the
    codes and scales `per_token_group_quant_fp8` gives the norm's output, with its `scale_m_major` and `out_rows`
    (Mp, rows past T quantised zeros) for a GEMM that reads them (`fp8_gemm.fp8_linear_quantized`).

    NOTE: bit for bit where the norm's output is `rmsnorm`'s. On the GPU this kernel may sum a row's squares in
    another order than `rmsnorm`'s compilation: bf16 outputs hide that, fp32 ones can differ by an ulp
    (benchmarks/results/prequant-h200.md).
    """
    _check(x, weight)
    assert group > 0 and group & (group - 1) == 0, f"group must be a power of two, got {group}"
    if residual is not None:
        _check(residual, weight, "residual")
        assert residual.shape == x.shape and residual.dtype == x.dtype, \
            f"residual must match x: {tuple(residual.shape)} {residual.dtype} vs {tuple(x.shape)} {x.dtype}"
    x_q, scale = quant_outputs(x, group, scale_m_major, out_rows)
    _launch(x, residual, weight, x_q, scale, eps, group)
    return x_q, scale


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF DeepseekV3RMSNorm: w * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype), returned in x.dtype."""
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (weight.float() * y.to(x.dtype).float()).to(x.dtype)


def fused_add_rmsnorm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                          eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for `fused_add_rmsnorm`; returns new tensors (does not modify `residual`)."""
    residual_out = (x.float() + residual.float()).to(x.dtype)
    return rmsnorm_ref(residual_out, weight, eps), residual_out


def rmsnorm_quant_fp8_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                          group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for `rmsnorm_quant_fp8` (no residual, row-major scales): the unfused composition norm ->
    per-token-group quant."""
    return per_token_group_quant_fp8_ref(rmsnorm_ref(x, weight, eps), group)
