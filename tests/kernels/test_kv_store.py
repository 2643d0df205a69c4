"""KV-cache store kernel vs its reference: bf16/fp16/fp32 and fp8 caches, scales, saturation, strided slots."""
from __future__ import annotations

import pytest
import torch

from mlaserve.kernels.kv_store import kv_store, kv_store_ref

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
SENTINEL = 3.0


def _setup(t: int, d: int, dtype: torch.dtype, cache_dtype: torch.dtype, device: str):
    """latent [T, D] as a row-strided view, slots a strided view of a permutation, cache rows set to a sentinel."""
    latent = torch.randn(t, d + 8, dtype=dtype, device=device)[:, :d] * 4
    num_slots = 2 * t + 3
    slots = torch.randperm(num_slots, device=device)[: 2 * t][::2]
    cache = torch.full((num_slots, d), SENTINEL, device=device).to(cache_dtype)
    return latent, slots, cache


def _untouched_rows_kept(cache: torch.Tensor, slots: torch.Tensor) -> bool:
    keep = torch.ones(cache.shape[0], dtype=torch.bool, device=cache.device)
    keep[slots.long()] = False
    return bool((cache[keep].float() == SENTINEL).all())


# A pure copy or cast: exact (atol = rtol = 0) for every dtype.
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float16, torch.float16), (torch.float32, torch.float32),
                                               (torch.float32, torch.float16)])
@pytest.mark.parametrize("t,d", [(1, 96), (37, 200)])
def test_kv_store_plain_cache_is_exact(t: int, d: int, dtype: torch.dtype, cache_dtype: torch.dtype,
                                       device: str) -> None:
    latent, slots, cache = _setup(t, d, dtype, cache_dtype, device)
    ref = cache.clone()
    kv_store(cache, slots, latent)
    kv_store_ref(ref, slots, latent)
    torch.testing.assert_close(cache, ref, atol=0, rtol=0)
    torch.testing.assert_close(cache[slots.long()], latent.to(cache_dtype), atol=0, rtol=0)
    assert _untouched_rows_kept(cache, slots)


@pytest.mark.parametrize("cache_dtype", FP8)
@pytest.mark.parametrize("scale_kind", [None, "float", "tensor"])
@pytest.mark.parametrize("t,d", [(1, 96), (37, 200)])
def test_kv_store_fp8_cache(t: int, d: int, scale_kind: str | None, cache_dtype: torch.dtype, device: str) -> None:
    latent, slots, cache = _setup(t, d, torch.float16, cache_dtype, device)
    latent[0, :4] = torch.tensor([6e4, -6e4, 1e-6, 0.0])         # saturates both ways; subnormal; zero
    scale = None if scale_kind is None else 0.5
    kv_scale = torch.tensor([scale], device=device) if scale_kind == "tensor" else scale
    ref = cache.clone()
    kv_store(cache, slots, latent, kv_scale=kv_scale)
    kv_store_ref(ref, slots, latent, kv_scale=scale)
    # fp16 -> fp32 / scale -> fp8 is computed identically; rounding to nearest even on both sides: exact.
    torch.testing.assert_close(cache.float(), ref.float(), atol=0, rtol=0)
    fmax = torch.finfo(cache_dtype).max
    row0 = cache[slots[0].long()].float()
    assert row0[0] == fmax and row0[1] == -fmax, "out-of-range values must saturate, not become NaN/inf"
    # What a reader sees: dequantised values within half an fp8 step (2^-4 / 2^-3 relative) of the input.
    deq = cache[slots.long()].float() * (scale or 1.0)
    rel = 2**-4 if cache_dtype == torch.float8_e4m3fn else 2**-3
    inside = latent.float().abs() <= fmax * (scale or 1.0)
    err = (deq - latent.float()).abs()
    assert (err[inside] <= latent.float().abs()[inside] * rel + 2**-9 * (scale or 1.0)).all()
    assert _untouched_rows_kept(cache, slots)


def test_kv_store_rejects_bad_inputs() -> None:
    latent, slots, cache = _setup(4, 96, torch.float16, torch.float16, "cpu")
    with pytest.raises(AssertionError, match="only to an fp8 cache"):
        kv_store(cache, slots, latent, kv_scale=0.5)
    with pytest.raises(AssertionError, match="kv_cache must be"):
        kv_store(cache[:, :95], slots, latent)
    with pytest.raises(AssertionError, match="out_slots"):
        kv_store(cache, slots.float(), latent)
