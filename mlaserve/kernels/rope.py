"""MLA rotary embedding fused with the latent KV-cache write (one launch per layer per step).

DeepSeek checkpoints hold rope dims as interleaved pairs (x0, x1), (x2, x3), ...; the output is de-interleaved
halves, as HF `apply_rotary_pos_emb_interleave` returns. Shapes: `T` tokens, `H` local heads, `R` rope dim (64),
`L` kv_lora_rank (512), `S` cache slots, `P` cached positions.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from mlaserve.kernels.kv_store import FP8_DTYPES, cache_values_ref, check_cache, fp8_consts, fp8_saturate, \
    scale_tensor
from mlaserve.kernels.norm import check_norm_operands, rmsnorm_ref
from mlaserve.kernels.pdl import pdl_enter, pdl_meta

_BLOCK_H = 16   # heads per program


@triton.jit
def _rotate(even_ptrs, mask, cos, sin):
    """Load interleaved pairs (x[2i] at `even_ptrs`, x[2i+1] next to it) and rotate: returns (lo, hi) halves."""
    x_even = tl.load(even_ptrs, mask=mask, other=0.0)
    ty = x_even.dtype
    x_even = x_even.to(tl.float32)
    x_odd = tl.load(even_ptrs + 1, mask=mask, other=0.0).to(tl.float32)
    return (x_even * cos - x_odd * sin).to(ty), (x_odd * cos + x_even * sin).to(ty)


@triton.jit
def _store_cache(ptrs, v, mask, scale_ptr, HAS_SCALE: tl.constexpr, IS_FP8: tl.constexpr,
                 FP8_MAX: tl.constexpr, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr, SOFT_ROUND: tl.constexpr):
    v = v.to(tl.float32)
    if IS_FP8:
        if HAS_SCALE:
            v = v / tl.load(scale_ptr)
        v = fp8_saturate(v, FP8_MAX, MANT_BITS, MIN_EXP, SOFT_ROUND)
    tl.store(ptrs, v.to(ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _mla_rope_kv_store_kernel(q_ptr, k_ptr, kvc_ptr, pos_ptr, cs_ptr, cache_ptr, slot_ptr, scale_ptr, nw_ptr,
                              eps, H, L, stride_qt, stride_qh, stride_kt, stride_ct, stride_pos, stride_cache,
                              stride_slot, R_HALF: tl.constexpr, BLOCK_RH: tl.constexpr, BLOCK_H: tl.constexpr,
                              BLOCK_L: tl.constexpr, NORM: tl.constexpr,
                              HAS_SCALE: tl.constexpr, IS_FP8: tl.constexpr, FP8_MAX: tl.constexpr,
                              MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr, SOFT_ROUND: tl.constexpr,
                              PDL: tl.constexpr):
    pdl_enter(PDL)
    rope_kv_store_program(tl.program_id(0).to(tl.int64), tl.program_id(1), q_ptr, k_ptr, kvc_ptr, pos_ptr, cs_ptr,
                          cache_ptr, slot_ptr, scale_ptr, nw_ptr, eps, H, L, stride_qt, stride_qh, stride_kt,
                          stride_ct, stride_pos, stride_cache, stride_slot, R_HALF, BLOCK_RH, BLOCK_H, BLOCK_L, NORM,
                          HAS_SCALE, IS_FP8, FP8_MAX, MANT_BITS, MIN_EXP, SOFT_ROUND)


@triton.jit
def rope_kv_store_program(t, hb, q_ptr, k_ptr, kvc_ptr, pos_ptr, cs_ptr, cache_ptr, slot_ptr, scale_ptr, nw_ptr,
                          eps, H, L, stride_qt, stride_qh, stride_kt, stride_ct, stride_pos, stride_cache,
                          stride_slot, R_HALF: tl.constexpr, BLOCK_RH: tl.constexpr, BLOCK_H: tl.constexpr,
                          BLOCK_L: tl.constexpr, NORM: tl.constexpr,
                          HAS_SCALE: tl.constexpr, IS_FP8: tl.constexpr, FP8_MAX: tl.constexpr,
                          MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr, SOFT_ROUND: tl.constexpr):
    # Program (t, hb) rotates heads [hb * BLOCK_H, (hb + 1) * BLOCK_H) of token t; hb == 0 also handles k / kv.
    # (Also run inside mla_absorb's combined launch, which hands it its (t, hb).)
    cos, sin, slot = rope_kv_operands(t, True, hb == 0, pos_ptr, cs_ptr, slot_ptr, stride_pos, stride_slot, R_HALF,
                                      BLOCK_RH)
    rope_kv_apply(t, hb, cos, sin, slot, q_ptr, k_ptr, kvc_ptr, cache_ptr, scale_ptr, nw_ptr, eps, H, L, stride_qt,
                  stride_qh, stride_kt, stride_ct, stride_cache, R_HALF, BLOCK_RH, BLOCK_H, BLOCK_L, NORM, HAS_SCALE,
                  IS_FP8, FP8_MAX, MANT_BITS, MIN_EXP, SOFT_ROUND)


@triton.jit
def rope_kv_operands(t, active, with_slot, pos_ptr, cs_ptr, slot_ptr, stride_pos, stride_slot,
                     R_HALF: tl.constexpr, BLOCK_RH: tl.constexpr):
    """Token t's (cos [BLOCK_RH], sin [BLOCK_RH], cache slot; the slot read only `with_slot`, else 0; nothing read
    unless `active`): what `rope_kv_apply` needs besides the rows it rotates. Positions and slots are the step's
    inputs, no kernel's output: a PDL kernel may read them before its wait (mla_chain does)."""
    i = tl.arange(0, BLOCK_RH)                                                # pair index (padded to a power of 2)
    i_ok = i < R_HALF
    pos = tl.load(pos_ptr + t * stride_pos, mask=active, other=0).to(tl.int64)
    cos = tl.load(cs_ptr + pos * (2 * R_HALF) + i, mask=i_ok & active, other=0.0)      # [R/2] (mscale folded in)
    sin = tl.load(cs_ptr + pos * (2 * R_HALF) + R_HALF + i, mask=i_ok & active, other=0.0)
    slot = tl.load(slot_ptr + t * stride_slot, mask=active & with_slot, other=0).to(tl.int64)
    return cos, sin, slot


@triton.jit
def rope_kv_apply(t, hb, cos, sin, slot, q_ptr, k_ptr, kvc_ptr, cache_ptr, scale_ptr, nw_ptr, eps, H, L, stride_qt,
                  stride_qh, stride_kt, stride_ct, stride_cache, R_HALF: tl.constexpr, BLOCK_RH: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr, NORM: tl.constexpr, HAS_SCALE: tl.constexpr,
                  IS_FP8: tl.constexpr, FP8_MAX: tl.constexpr, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr,
                  SOFT_ROUND: tl.constexpr):
    # `rope_kv_store_program` with its operands (`rope_kv_operands`) read
    i = tl.arange(0, BLOCK_RH)
    i_ok = i < R_HALF
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = (heads < H)[:, None] & i_ok[None, :]
    q_row = q_ptr + t * stride_qt + heads[:, None].to(tl.int64) * stride_qh    # [BH, 1]
    q_lo, q_hi = _rotate(q_row + 2 * i[None, :], hmask, cos[None, :], sin[None, :])
    k_row = k_ptr + t * stride_kt
    k_lo, k_hi = _rotate(k_row + 2 * i, i_ok, cos, sin)
    # NOTE: rows are rotated in place and one thread's store can hit another thread's load: all loads first.
    tl.debug_barrier()
    tl.store(q_row + i[None, :], q_lo, mask=hmask)
    tl.store(q_row + R_HALF + i[None, :], q_hi, mask=hmask)
    if hb == 0:
        tl.store(k_row + i, k_lo, mask=i_ok)
        tl.store(k_row + R_HALF + i, k_hi, mask=i_ok)
        # cache row: [ kv_c (L) | rot(k_pe) (R) ]
        c_row = cache_ptr + slot * stride_cache
        lo = tl.arange(0, BLOCK_L)
        kv = tl.load(kvc_ptr + t * stride_ct + lo, mask=lo < L, other=0.0)
        if NORM:                                     # kv_a_layernorm, as rmsnorm_ref rounds it; kv_c updated in place
            ty = kv.dtype
            x = kv.to(tl.float32)
            y = (x * tl.math.rsqrt(tl.sum(x * x, axis=0) / L + eps)).to(ty).to(tl.float32)
            kv = (tl.load(nw_ptr + lo, mask=lo < L, other=0.0).to(tl.float32) * y).to(ty)
            tl.store(kvc_ptr + t * stride_ct + lo, kv, mask=lo < L)
        _store_cache(c_row + lo, kv, lo < L, scale_ptr, HAS_SCALE, IS_FP8, FP8_MAX, MANT_BITS, MIN_EXP, SOFT_ROUND)
        _store_cache(c_row + L + i, k_lo, i_ok, scale_ptr, HAS_SCALE, IS_FP8, FP8_MAX, MANT_BITS, MIN_EXP,
                     SOFT_ROUND)
        _store_cache(c_row + L + R_HALF + i, k_hi, i_ok, scale_ptr, HAS_SCALE, IS_FP8, FP8_MAX, MANT_BITS,
                     MIN_EXP, SOFT_ROUND)


def _check(q_pe: torch.Tensor, k_pe: torch.Tensor, kv_c: torch.Tensor, positions: torch.Tensor,
           cos_sin_cache: torch.Tensor) -> None:
    t, _, r = q_pe.shape
    assert r % 2 == 0 and r > 0, f"rope dim must be even, got {r}"
    assert q_pe.stride(2) == 1, f"q_pe last dim must be contiguous, strides {q_pe.stride()}"
    assert k_pe.shape == (t, r) and k_pe.stride(1) == 1, \
        f"k_pe must be [{t}, {r}] with contiguous last dim, got {tuple(k_pe.shape)} strides {k_pe.stride()}"
    assert kv_c.dim() == 2 and kv_c.shape[0] == t and kv_c.stride(1) == 1, \
        f"kv_c must be [{t}, L] with contiguous last dim, got {tuple(kv_c.shape)} strides {kv_c.stride()}"
    assert q_pe.dtype == k_pe.dtype == kv_c.dtype and q_pe.dtype in (torch.bfloat16, torch.float16, torch.float32), \
        f"q_pe, k_pe, kv_c must share a float dtype, got {q_pe.dtype}, {k_pe.dtype}, {kv_c.dtype}"
    assert positions.shape == (t,) and positions.dtype in (torch.int32, torch.int64), \
        f"positions must be [{t}] int32/int64, got {tuple(positions.shape)} {positions.dtype}"
    assert cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] == r and cos_sin_cache.dtype == torch.float32 \
        and cos_sin_cache.is_contiguous(), \
        f"cos_sin_cache must be contiguous float32 [P, {r}], got {tuple(cos_sin_cache.shape)} {cos_sin_cache.dtype}"
    for name, v in (("k_pe", k_pe), ("kv_c", kv_c), ("positions", positions), ("cos_sin_cache", cos_sin_cache)):
        assert v.device == q_pe.device, f"{name} on {v.device}, q_pe on {q_pe.device}"


def mla_rope_kv_store(q_pe: torch.Tensor, k_pe: torch.Tensor, kv_c: torch.Tensor, positions: torch.Tensor,
                      cos_sin_cache: torch.Tensor, kv_cache: torch.Tensor, out_slots: torch.Tensor, *,
                      kv_scale: float | torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                      eps: float = 0.0) -> None:
    """Rotate q_pe and k_pe IN PLACE and write cat(kv_c, rot(k_pe)) into kv_cache[out_slots], in one launch.
    With `norm_weight` [L], kv_c is first RMS-normalised IN PLACE (kv_a_layernorm with `eps`).

    Args:
        q_pe: [T, H, R] interleaved rope part of q; may be a strided view into q [T, H, 192] (last dim
            contiguous). Overwritten with its rotation in de-interleaved layout.
        k_pe: [T, R] interleaved shared rope key (rows may be strided); overwritten likewise.
        kv_c: [T, L] RMS-normalised latent (rows may be strided); raw when `norm_weight` is given.
        positions: [T] int32/int64 position of each token (any stride), < P.
        cos_sin_cache: [P, R] float32: cos(pos * inv_freq_i) * m in columns [0, R/2), sin * m in [R/2, R).
        kv_cache: [S, L + R] of one layer, dtype of q_pe or fp8 (e4m3 / e5m2).
        out_slots: [T] int32/int64 distinct slots in [0, S) (any stride).
        kv_scale: fp8 cache only: it stores clamp(value / kv_scale, +-fp8 max).
    """
    args, meta, grid = rope_launch_args(q_pe, k_pe, kv_c, positions, cos_sin_cache, kv_cache, out_slots,
                                        kv_scale=kv_scale, norm_weight=norm_weight, eps=eps)
    if q_pe.shape[0]:
        _mla_rope_kv_store_kernel[grid](*args, **meta, **pdl_meta(q_pe.device), num_warps=4)


def rope_launch_args(q_pe: torch.Tensor, k_pe: torch.Tensor, kv_c: torch.Tensor, positions: torch.Tensor,
                     cos_sin_cache: torch.Tensor, kv_cache: torch.Tensor, out_slots: torch.Tensor, *,
                     kv_scale: float | torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                     eps: float = 0.0) -> tuple[tuple, dict, tuple[int, int]]:
    """`mla_rope_kv_store`'s checks, then (`rope_kv_store_program`'s arguments after (t, hb), its constexprs,
    the grid (T, head blocks))."""
    _check(q_pe, k_pe, kv_c, positions, cos_sin_cache)
    t, h, r = q_pe.shape
    l = kv_c.shape[1]
    check_cache(kv_cache, out_slots, t, l + r)
    assert kv_cache.dtype in (q_pe.dtype, *FP8_DTYPES), f"kv_cache dtype {kv_cache.dtype} must be {q_pe.dtype} or fp8"
    scale = scale_tensor(kv_scale, kv_cache)
    if norm_weight is not None:
        check_norm_operands(kv_c, norm_weight)
    block_h = min(_BLOCK_H, triton.next_power_of_2(h))
    args = (q_pe, k_pe, kv_c, positions, cos_sin_cache, kv_cache, out_slots, scale if scale is not None else kv_cache,
            norm_weight if norm_weight is not None else kv_c, float(eps), h, l, q_pe.stride(0), q_pe.stride(1),
            k_pe.stride(0), kv_c.stride(0), positions.stride(0), kv_cache.stride(0), out_slots.stride(0))
    meta = dict(R_HALF=r // 2, BLOCK_RH=triton.next_power_of_2(r // 2), BLOCK_H=block_h,
                BLOCK_L=triton.next_power_of_2(l), NORM=norm_weight is not None, HAS_SCALE=scale is not None,
                **fp8_consts(kv_cache.dtype, kv_cache.device))
    return args, meta, (t, triton.cdiv(h, block_h))


def rope_ref(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved rope dims: x [T, ..., R] -> [T, ..., R] de-interleaved halves, in fp32 then x.dtype.

    out = cat(x_even * cos - x_odd * sin, x_odd * cos + x_even * sin), cos/sin = cos_sin_cache[positions] halves.
    """
    r = x.shape[-1]
    cs = cos_sin_cache[positions.long()].float()                              # [T, R]
    cs = cs.view(cs.shape[0], *([1] * (x.dim() - 2)), r)                       # broadcast over heads
    cos, sin = cs[..., : r // 2], cs[..., r // 2:]
    x_even, x_odd = x.float()[..., 0::2], x.float()[..., 1::2]
    return torch.cat([x_even * cos - x_odd * sin, x_odd * cos + x_even * sin], dim=-1).to(x.dtype)


def mla_rope_kv_store_ref(q_pe: torch.Tensor, k_pe: torch.Tensor, kv_c: torch.Tensor, positions: torch.Tensor,
                          cos_sin_cache: torch.Tensor, kv_cache: torch.Tensor, out_slots: torch.Tensor, *,
                          kv_scale: float | torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                          eps: float = 0.0) -> None:
    """Reference for `mla_rope_kv_store`, with the same in-place effects on q_pe, k_pe, kv_c and kv_cache."""
    if norm_weight is not None:
        kv_c.copy_(rmsnorm_ref(kv_c, norm_weight, eps))
    q_pe.copy_(rope_ref(q_pe, positions, cos_sin_cache))
    k_pe.copy_(rope_ref(k_pe, positions, cos_sin_cache))
    kv_cache[out_slots.long()] = cache_values_ref(torch.cat([kv_c, k_pe], dim=-1), kv_cache.dtype, kv_scale)
