"""Benchmark cases for the small fused ops (RMSNorm variants, SiLU-and-mul, MLA rope + KV store, KV store).

All are bandwidth-bound: each row reports TB/s over the minimal bytes moved and its fraction of copy bandwidth.
"""
from __future__ import annotations

from typing import Callable, Iterator

import torch

from mlaserve.bench.timing import Ceilings, time_cuda
from mlaserve.kernels import activation as act
from mlaserve.kernels import kv_store as kvs
from mlaserve.kernels import norm, rope

BF16 = 2                  # bytes per bf16 element
DTYPE = torch.bfloat16
TOL_BF16 = 2e-2           # max |out - ref| / max |ref|: two to three bf16 ulps of the largest value
TOL_FP8 = 0.13            # dequantised fp8: one e4m3 ulp (2^-3 relative) of the largest value
HIDDEN = (2048, 7168)     # V2-Lite, V3 hidden_size
KV_LORA_RANK, ROPE_DIM = 512, 64


def norm_bytes(t: int, d: int, *, residual: bool = False, quant: bool = False, group: int = 128) -> int:
    """Minimal HBM bytes of one (fused) RMSNorm: read x (+ residual) and weight; write out (+ residual)."""
    out = t * d + t * -(-d // group) * 4 if quant else t * d * BF16
    return t * d * BF16 * (3 if residual else 1) + d * BF16 + out


def silu_bytes(t: int, i: int, *, quant: bool = False, group: int = 128) -> int:
    """Read [T, 2I] gate|up, write [T, I] (bf16, or fp8 plus one float32 scale per group)."""
    out = t * i + t * -(-i // group) * 4 if quant else t * i * BF16
    return t * 2 * i * BF16 + out


def rope_kv_bytes(t: int, h: int, r: int = ROPE_DIM, l: int = KV_LORA_RANK, *, cache_elt: int = BF16) -> int:
    """q_pe and k_pe read + written, kv_c read, cache row written, positions/slots (int64) and cos/sin read."""
    return 2 * t * (h + 1) * r * BF16 + t * l * BF16 + t * (l + r) * cache_elt + 2 * t * 8 + t * r * 4


def kv_store_bytes(t: int, d: int = KV_LORA_RANK + ROPE_DIM, *, cache_elt: int = BF16) -> int:
    return t * d * BF16 + t * d * cache_elt + t * 8


def norm_flops(t: int, d: int) -> int:
    return 4 * t * d          # square-add, scale, weight


def silu_flops(t: int, i: int) -> int:
    return 5 * t * i          # exp, add, divide, two multiplies


def rope_flops(t: int, h: int, r: int = ROPE_DIM) -> int:
    return 3 * t * (h + 1) * r   # 4 mul + 2 add per pair


def cos_sin_cache(max_pos: int, r: int, device: str | torch.device, base: float = 10000.0) -> torch.Tensor:
    """[max_pos, r] float32 cos | sin of pos * inv_freq (mscale 1): rotations keep norms, so repeats stay finite."""
    inv_freq = 1.0 / base ** (torch.arange(0, r, 2, device=device, dtype=torch.float32) / r)
    ang = torch.arange(max_pos, device=device, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return torch.cat([ang.cos(), ang.sin()], dim=-1)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30)).item()


def _row(kernel: str, shape: str, fn: Callable[[], object], nbytes: int, flops: int, ceil: Ceilings,
         err: float, tol: float) -> dict:
    ms = time_cuda(fn)
    bps = nbytes / (ms * 1e-3)
    return dict(kernel=kernel, shape=shape, ms=ms, tbps=bps / 1e12, tflops=flops / (ms * 1e-3) / 1e12,
                bound="bw", frac=bps / ceil["copy_bps"], target=None, err=err, ok=err <= tol)


def _dequant(q: torch.Tensor, scale: torch.Tensor, group: int = 128) -> torch.Tensor:
    return q.float() * scale.repeat_interleave(group, dim=1)[:, : q.shape[1]]


def _norm_cases(ceil: Ceilings, quick: bool) -> Iterator[dict]:
    for t in ((64, 4096) if quick else (1, 64, 4096)):
        for d in HIDDEN:
            shape = f"T={t} D={d}"
            x, w = torch.randn(t, d, device="cuda", dtype=DTYPE), torch.rand(d, device="cuda", dtype=DTYPE) + 0.5
            res = torch.randn_like(x)
            err = rel_err(norm.rmsnorm(x, w, 1e-6), norm.rmsnorm_ref(x, w, 1e-6))
            yield _row("rmsnorm", shape, lambda: norm.rmsnorm(x, w, 1e-6), norm_bytes(t, d), norm_flops(t, d),
                       ceil, err, TOL_BF16)
            out, _ = norm.fused_add_rmsnorm(x, res.clone(), w, 1e-6)
            err = rel_err(out, norm.fused_add_rmsnorm_ref(x, res, w, 1e-6)[0])
            yield _row("fused_add_rmsnorm", shape, lambda: norm.fused_add_rmsnorm(x, res, w, 1e-6),
                       norm_bytes(t, d, residual=True), norm_flops(t, d) + t * d, ceil, err, TOL_BF16)
            q, s = norm.rmsnorm_quant_fp8(x, w, 1e-6)
            err = rel_err(_dequant(q, s), _dequant(*norm.rmsnorm_quant_fp8_ref(x, w, 1e-6)))
            yield _row("rmsnorm_quant_fp8", shape, lambda: norm.rmsnorm_quant_fp8(x, w, 1e-6),
                       norm_bytes(t, d, quant=True), norm_flops(t, d), ceil, err, TOL_FP8)


def _silu_cases(ceil: Ceilings, quick: bool) -> Iterator[dict]:
    for i in ((2048,) if quick else (1408, 2048)):     # V2-Lite / V3 moe_intermediate_size
        t = 4096
        shape = f"T={t} I={i}"
        x = torch.randn(t, 2 * i, device="cuda", dtype=DTYPE)
        err = rel_err(act.silu_and_mul(x), act.silu_and_mul_ref(x))
        yield _row("silu_and_mul", shape, lambda: act.silu_and_mul(x), silu_bytes(t, i), silu_flops(t, i),
                   ceil, err, TOL_BF16)
        err = rel_err(_dequant(*act.silu_and_mul_quant_fp8(x)), _dequant(*act.silu_and_mul_quant_fp8_ref(x)))
        yield _row("silu_and_mul_quant_fp8", shape, lambda: act.silu_and_mul_quant_fp8(x),
                   silu_bytes(t, i, quant=True), silu_flops(t, i), ceil, err, TOL_FP8)


def _rope_case(ceil: Ceilings, t: int, h: int, cache_dtype: torch.dtype) -> dict:
    r, l = ROPE_DIM, KV_LORA_RANK
    q = torch.randn(t, h, 128 + r, device="cuda", dtype=DTYPE)            # [T, H, 192]; q_pe is its tail
    kv_a = torch.randn(t, l + r, device="cuda", dtype=DTYPE)               # kv_a_proj_with_mqa output
    pos = torch.randint(0, 8192, (t,), device="cuda")
    cs = cos_sin_cache(8192, r, "cuda")
    slots = torch.randperm(4 * t, device="cuda")[:t]
    cache = torch.zeros(4 * t, l + r, device="cuda", dtype=cache_dtype)
    scale = 0.05 if cache_dtype != DTYPE else None
    args = lambda qq, kk, cc: (qq[..., 128:], kk[:, l:], kk[:, :l], pos, cs, cc, slots)  # noqa: E731
    q2, kv2, cache2 = q.clone(), kv_a.clone(), cache.clone()
    rope.mla_rope_kv_store(*args(q, kv_a, cache), kv_scale=scale)
    rope.mla_rope_kv_store_ref(*args(q2, kv2, cache2), kv_scale=scale)
    f = 1.0 if scale is None else scale
    err = max(rel_err(q, q2), rel_err(cache[slots].float() * f, cache2[slots].float() * f))
    fp8 = cache_dtype != DTYPE
    return _row("mla_rope_kv_store", f"T={t} H={h} cache={'fp8' if fp8 else 'bf16'}",
                lambda: rope.mla_rope_kv_store(*args(q, kv_a, cache), kv_scale=scale),
                rope_kv_bytes(t, h, cache_elt=1 if fp8 else BF16), rope_flops(t, h), ceil, err,
                TOL_FP8 if fp8 else TOL_BF16)


def _kv_store_case(ceil: Ceilings, t: int) -> dict:
    d = KV_LORA_RANK + ROPE_DIM
    latent = torch.randn(t, d, device="cuda", dtype=DTYPE)
    slots = torch.randperm(4 * t, device="cuda")[:t]
    cache, cache2 = (torch.zeros(4 * t, d, device="cuda", dtype=DTYPE) for _ in range(2))
    kvs.kv_store(cache, slots, latent)
    kvs.kv_store_ref(cache2, slots, latent)
    return _row("kv_store", f"T={t} D={d}", lambda: kvs.kv_store(cache, slots, latent), kv_store_bytes(t, d),
                0, ceil, rel_err(cache, cache2), TOL_BF16)


def cases(ceil: Ceilings, quick: bool) -> Iterator[dict]:
    """Rows for `mlaserve bench kernels` at DeepSeek-V2-Lite / V3 shapes (CUDA only)."""
    yield from _norm_cases(ceil, quick)
    yield from _silu_cases(ceil, quick)
    for t in (64, 4096):
        for h in ((128,) if quick else (16, 128)):
            for cache_dtype in (DTYPE, torch.float8_e4m3fn):
                yield _rope_case(ceil, t, h, cache_dtype)
        yield _kv_store_case(ceil, t)
