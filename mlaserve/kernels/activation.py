"""SwiGLU activation of the DeepSeek MLP / experts: silu(gate) * up, optionally fused with fp8 quantisation.

Shapes: `T` tokens, `I` intermediate size (x holds [gate | up] = [T, 2I]), `G = ceil(I / group)`.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mlaserve.kernels.kv_store import fp8_consts, num_warps_for, store_row_maybe_fp8
from mlaserve.kernels.pdl import pdl_enter, pdl_meta
from mlaserve.kernels.quant import FP8_MIN_SCALE, per_token_group_quant_fp8_ref, quant_outputs

_TILE = 128          # channels per tile row when not quantising
_MAX_BLOCK = 2048    # channels per program; wider rows use several programs


@triton.jit(do_not_specialize=["T"])
def _silu_and_mul_kernel(x_ptr, out_ptr, scale_ptr, T, I, stride_x, stride_out, stride_scale, stride_scale_g,
                         GROUP: tl.constexpr, BLOCK_G: tl.constexpr, QUANT: tl.constexpr,
                         IS_FP8: tl.constexpr, FP8_MAX: tl.constexpr, MANT_BITS: tl.constexpr,
                         MIN_EXP: tl.constexpr, SOFT_ROUND: tl.constexpr, MIN_SCALE: tl.constexpr,
                         PDL: tl.constexpr):
    pdl_enter(PDL)
    # Program (t, b) covers channels [b * BLOCK_G * GROUP, (b + 1) * BLOCK_G * GROUP) of row t. Rows T.. of the grid
    # (padding of a quantised output) read as zeros: codes 0, the scale of an all-zero group.
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)                    # [BG] group ids
    offs = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]                   # [BG, GROUP]
    mask = offs < I
    row_mask = mask & (offs * 0 + row < T)
    gate = tl.load(x_ptr + row * stride_x + offs, mask=row_mask, other=0.0)
    in_ty = gate.dtype
    gate = gate.to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + I + offs, mask=row_mask, other=0.0).to(tl.float32)
    y = (gate / (1.0 + tl.exp(-gate)) * up).to(in_ty)                         # silu(gate) * up, in x.dtype
    store_row_maybe_fp8(y, out_ptr + row * stride_out, scale_ptr + row * stride_scale, offs, mask, g, I, QUANT,
                        FP8_MAX, MANT_BITS, MIN_EXP, SOFT_ROUND, MIN_SCALE, GROUP, stride_scale_g)


def _check(x: torch.Tensor) -> int:
    assert x.dim() == 2 and x.shape[1] % 2 == 0, f"x must be [T, 2I], got {tuple(x.shape)}"
    assert x.stride(1) == 1, f"x last dim must be contiguous, strides {x.stride()}"
    assert x.dtype in (torch.bfloat16, torch.float16, torch.float32), f"x must be bf16/fp16/fp32, got {x.dtype}"
    return x.shape[1] // 2


def _launch(x: torch.Tensor, out: torch.Tensor, scale: torch.Tensor | None, group: int) -> None:
    # out: [Mp, I], Mp >= T rows of x (rows past T: padding, quantised outputs only)
    m, i = out.shape
    if m == 0:
        return
    block_g = min(triton.next_power_of_2(triton.cdiv(i, group)), max(1, _MAX_BLOCK // group))
    grid = (m, triton.cdiv(triton.cdiv(i, group), block_g))
    _silu_and_mul_kernel[grid](
        x, out, scale if scale is not None else out, x.shape[0], i, x.stride(0), out.stride(0),
        scale.stride(0) if scale is not None else 0, scale.stride(1) if scale is not None else 0,
        GROUP=group, BLOCK_G=block_g, QUANT=scale is not None, **fp8_consts(out.dtype, out.device),
        MIN_SCALE=FP8_MIN_SCALE, **pdl_meta(x.device), num_warps=num_warps_for(block_g * group))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = [gate | up] (rows may be strided) -> silu(gate) * up, a new [T, I] in x.dtype."""
    i = _check(x)
    out = torch.empty((x.shape[0], i), dtype=x.dtype, device=x.device)
    _launch(x, out, None, _TILE)
    return out


def silu_and_mul_quant_fp8(x: torch.Tensor, group: int = 128, scale_m_major: bool = False,
                           out_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """silu_and_mul(x) (rounded to x.dtype) quantised per token per `group` channels to fp8 e4m3.

    Returns (y_q [Mp, I] e4m3, scale [Mp, ceil(I / group)] float32), y_q * scale ~= silu_and_mul(x) per group: the
    codes and scales `per_token_group_quant_fp8` gives silu_and_mul's output, with its `scale_m_major` and
    `out_rows` (Mp, rows past T quantised zeros).
    """
    i = _check(x)
    assert group > 0 and group & (group - 1) == 0, f"group must be a power of two, got {group}"
    y_q, scale = quant_outputs(x[:, :i], group, scale_m_major, out_rows)
    _launch(x, y_q, scale, group)
    return y_q, scale


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """Reference: silu(gate) * up computed in fp32, rounded once to x.dtype."""
    gate, up = x.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(x.dtype)


def silu_and_mul_quant_fp8_ref(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for `silu_and_mul_quant_fp8`: the unfused composition activation -> per-token-group quant."""
    return per_token_group_quant_fp8_ref(silu_and_mul_ref(x), group)
