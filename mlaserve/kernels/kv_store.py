"""KV-cache store: write latent rows into the MLA cache at their slots (fp8 cache: value / kv_scale, saturated).

Also holds the fp8 rounding helpers the small fused kernels share (norm, activation, rope).
Shapes: `T` tokens, `S` cache slots, `D` values per slot (L + R = 576 for DeepSeek), `G` groups per row.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mlaserve.kernels.quant import fp8_max, round_to_fp8_grid

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# dtype -> (mantissa bits, exponent of the smallest normal)
_FP8_GRID = {torch.float8_e4m3fn: (3, -6), torch.float8_e5m2: (2, -14)}


def fp8_consts(dtype: torch.dtype, device: torch.device) -> dict:
    """Constexpr kwargs describing `dtype` for `fp8_saturate` (harmless for non-fp8 dtypes)."""
    mant, min_exp = _FP8_GRID.get(dtype, (3, -6))
    return dict(IS_FP8=dtype in FP8_DTYPES, FP8_MAX=fp8_max(dtype), MANT_BITS=mant, MIN_EXP=min_exp,
                SOFT_ROUND=device.type != "cuda")


@triton.jit
def fp8_saturate(v, FP8_MAX: tl.constexpr, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr,
                 SOFT_ROUND: tl.constexpr):
    """Clamp fp32 `v` to [-FP8_MAX, FP8_MAX], rounded onto the fp8 grid in software under the interpreter."""
    v = tl.minimum(tl.maximum(v, -FP8_MAX), FP8_MAX)
    if SOFT_ROUND:
        v = round_to_fp8_grid(v, MANT_BITS, MIN_EXP)
    return v


@triton.jit
def fp8_quant_groups(y, FP8_MAX: tl.constexpr, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr,
                     SOFT_ROUND: tl.constexpr, MIN_SCALE: tl.constexpr):
    """Per-group fp8 quantisation of an fp32 tile y [BG, GROUP] (padding must be 0): returns (q fp32, scale [BG]).

    NOTE: correctly rounded divisions, as `per_token_group_quant_fp8` (GPU `/` is approximate): the codes and
    scales of a fused producer are those of its unfused output quantised by that pass."""
    amax = tl.max(tl.abs(y), axis=1)                                 # [BG]
    scale = tl.math.div_rn(tl.maximum(amax, MIN_SCALE), tl.full(amax.shape, FP8_MAX, tl.float32))
    q = fp8_saturate(tl.math.div_rn(y, tl.broadcast_to(scale[:, None], y.shape)), FP8_MAX, MANT_BITS, MIN_EXP,
                     SOFT_ROUND)
    return q, scale


@triton.jit
def store_row_maybe_fp8(y, out_row, scale_row, offs, mask, g, n, QUANT: tl.constexpr, FP8_MAX: tl.constexpr,
                        MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr, SOFT_ROUND: tl.constexpr,
                        MIN_SCALE: tl.constexpr, GROUP: tl.constexpr, stride_scale_g=1):
    """Epilogue of a row kernel: store y [BG, GROUP] as is, or fp8-quantised per group with its scales (group g's
    at scale_row + g * stride_scale_g)."""
    if QUANT:
        q, scale = fp8_quant_groups(y.to(tl.float32), FP8_MAX, MANT_BITS, MIN_EXP, SOFT_ROUND, MIN_SCALE)
        tl.store(out_row + offs, q.to(out_row.dtype.element_ty), mask=mask)
        tl.store(scale_row + g * stride_scale_g, scale, mask=g * GROUP < n)
    else:
        tl.store(out_row + offs, y, mask=mask)


@triton.jit
def _kv_store_kernel(cache_ptr, slot_ptr, src_ptr, scale_ptr, D, stride_cache, stride_slot, stride_src,
                     BLOCK_D: tl.constexpr, HAS_SCALE: tl.constexpr, IS_FP8: tl.constexpr,
                     FP8_MAX: tl.constexpr, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr,
                     SOFT_ROUND: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t * stride_slot).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    v = tl.load(src_ptr + t.to(tl.int64) * stride_src + offs, mask=mask, other=0.0).to(tl.float32)
    if IS_FP8:
        if HAS_SCALE:
            v = v / tl.load(scale_ptr)
        v = fp8_saturate(v, FP8_MAX, MANT_BITS, MIN_EXP, SOFT_ROUND)
    tl.store(cache_ptr + slot * stride_cache + offs, v.to(cache_ptr.dtype.element_ty), mask=mask)


def num_warps_for(block: int) -> int:
    """Warps for a one-row program over `block` elements (about 16 elements per thread, 1..16 warps)."""
    return max(1, min(16, block // 512))


def scale_tensor(kv_scale: float | torch.Tensor | None, cache: torch.Tensor) -> torch.Tensor | None:
    """Check `kv_scale` against the cache dtype and return it as a 1-element float32 tensor (or None)."""
    if kv_scale is None:
        return None
    assert cache.dtype in FP8_DTYPES, f"kv_scale applies only to an fp8 cache, got cache dtype {cache.dtype}"
    if isinstance(kv_scale, torch.Tensor):
        assert kv_scale.numel() == 1 and kv_scale.dtype == torch.float32, \
            f"kv_scale tensor must hold one float32, got {tuple(kv_scale.shape)} {kv_scale.dtype}"
        assert kv_scale.device == cache.device, f"kv_scale on {kv_scale.device}, cache on {cache.device}"
        return kv_scale.reshape(1)
    return torch.full((1,), float(kv_scale), dtype=torch.float32, device=cache.device)


def check_cache(kv_cache: torch.Tensor, out_slots: torch.Tensor, num_tokens: int, width: int) -> None:
    """Shared launcher checks: cache [S, width] with unit last stride, out_slots [T] integer."""
    assert kv_cache.dim() == 2 and kv_cache.shape[1] == width, \
        f"kv_cache must be [num_slots, {width}], got {tuple(kv_cache.shape)}"
    assert kv_cache.stride(1) == 1, f"kv_cache last dim must be contiguous, strides {kv_cache.stride()}"
    assert out_slots.shape == (num_tokens,), f"out_slots must be [{num_tokens}], got {tuple(out_slots.shape)}"
    assert out_slots.dtype in (torch.int32, torch.int64), f"out_slots must be int32/int64, got {out_slots.dtype}"
    assert out_slots.device == kv_cache.device, f"out_slots on {out_slots.device}, kv_cache on {kv_cache.device}"


def kv_store(kv_cache: torch.Tensor, out_slots: torch.Tensor, latent: torch.Tensor,
             kv_scale: float | torch.Tensor | None = None) -> None:
    """Write `kv_cache[out_slots[t]] = latent[t]` for every token, in one launch (one program per token).

    Args:
        kv_cache: [S, D] cache of one layer (bf16/fp16/fp32, or fp8 e4m3/e5m2), last dim contiguous.
        out_slots: [T] int32/int64 slot per token (any stride); slots must be distinct and in [0, S).
        latent: [T, D] rows to store (last dim contiguous); float dtype.
        kv_scale: fp8 cache only: the cache holds clamp(latent / kv_scale, +-fp8 max) (float or 1-elem tensor).
    """
    t, d = latent.shape
    check_cache(kv_cache, out_slots, t, d)
    assert latent.stride(1) == 1, f"latent last dim must be contiguous, strides {latent.stride()}"
    assert latent.is_floating_point() and latent.device == kv_cache.device, \
        f"latent must be a float tensor on {kv_cache.device}, got {latent.dtype} on {latent.device}"
    scale = scale_tensor(kv_scale, kv_cache)
    if t == 0:
        return
    block = triton.next_power_of_2(d)
    _kv_store_kernel[(t,)](
        kv_cache, out_slots, latent, scale if scale is not None else kv_cache, d,
        kv_cache.stride(0), out_slots.stride(0), latent.stride(0),
        BLOCK_D=block, HAS_SCALE=scale is not None, **fp8_consts(kv_cache.dtype, kv_cache.device),
        num_warps=num_warps_for(block))


def cache_values_ref(v: torch.Tensor, cache_dtype: torch.dtype,
                     kv_scale: float | torch.Tensor | None = None) -> torch.Tensor:
    """Values as the cache holds them: fp8 -> clamp(v / kv_scale, +-max) cast (round to nearest); else a cast."""
    if cache_dtype not in FP8_DTYPES:
        return v.to(cache_dtype)
    v = v.float() if kv_scale is None else v.float() / kv_scale
    return v.clamp(-fp8_max(cache_dtype), fp8_max(cache_dtype)).to(cache_dtype)


def kv_store_ref(kv_cache: torch.Tensor, out_slots: torch.Tensor, latent: torch.Tensor,
                 kv_scale: float | torch.Tensor | None = None) -> None:
    """Reference for `kv_store` (same in-place effect on `kv_cache`)."""
    kv_cache[out_slots.long()] = cache_values_ref(latent, kv_cache.dtype, kv_scale)

