"""MLA rope + fused KV-cache write vs its reference; the rope reference vs HF and DeepSeek-V2's complex form."""
from __future__ import annotations

import pytest
import torch

from mlaserve.bench.kernel_cases import small_ops
from mlaserve.kernels.norm import rmsnorm_ref
from mlaserve.kernels.rope import mla_rope_kv_store, mla_rope_kv_store_ref, rope_ref

# Tolerances (abs = rel): fp32 1e-5 (FMA contraction on GPU); fp16 2e-3 (~2 ulp); bf16 1.6e-2 (GPU only).
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
R, L, NOPE = 64, 200, 128        # qk_rope_head_dim, a kv_lora_rank that is not a power of two, qk_nope_head_dim


def _cos_sin(max_pos: int, r: int, mscale: float, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (cos_sin_cache [P, R] = [cos * m | sin * m], angles [P, R/2])."""
    inv_freq = 1.0 / 10000.0 ** (torch.arange(0, r, 2, dtype=torch.float32, device=device) / r)
    ang = torch.arange(max_pos, dtype=torch.float32, device=device)[:, None] * inv_freq
    return torch.cat([ang.cos() * mscale, ang.sin() * mscale], dim=-1), ang


def test_rope_ref_matches_hf_interleave() -> None:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave
    t, h = 7, 3
    cache, _ = _cos_sin(100, R, mscale=1.3)
    pos = torch.randint(0, 100, (t,))
    q, k = torch.randn(t, h, R), torch.randn(t, 1, R)
    cs = cache[pos]                                                   # [T, R]
    cos = torch.cat([cs[:, : R // 2]] * 2, dim=-1)                   # HF passes cat(freqs, freqs) angles
    sin = torch.cat([cs[:, R // 2:]] * 2, dim=-1)
    q_hf, k_hf = apply_rotary_pos_emb_interleave(q, k, cos, sin, unsqueeze_dim=1)
    torch.testing.assert_close(rope_ref(q, pos, cache), q_hf, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(rope_ref(k[:, 0], pos, cache), k_hf[:, 0], atol=1e-6, rtol=1e-6)


def test_rope_ref_matches_v2_complex_form() -> None:
    # DeepSeek-V2: pairs (x[2i], x[2i+1]) as complex numbers times m * e^{i * pos * inv_freq_i}, re-interleaved.
    t, h, m = 9, 4, 0.8
    cache, ang = _cos_sin(64, R, mscale=m)
    pos = torch.randint(0, 64, (t,))
    x = torch.randn(t, h, R)
    freqs_cis = torch.polar(torch.full_like(ang[pos], m), ang[pos])[:, None, :]     # [T, 1, R/2]
    rot = torch.view_as_real(torch.view_as_complex(x.view(t, h, R // 2, 2)) * freqs_cis).flatten(-2)
    out = rope_ref(x, pos, cache)
    interleaved = torch.stack([out[..., : R // 2], out[..., R // 2:]], dim=-1).flatten(-2)
    torch.testing.assert_close(interleaved, rot, atol=1e-5, rtol=1e-5)


def test_rope_scores_depend_on_relative_position() -> None:
    # q and k get the same layout, so q.k after rope depends only on pos_q - pos_k (mscale 1).
    cache, _ = _cos_sin(64, R, mscale=1.0)
    q, k = torch.randn(1, R), torch.randn(1, R)
    def score(pq: int, pk: int) -> torch.Tensor:
        return (rope_ref(q, torch.tensor([pq]), cache) * rope_ref(k, torch.tensor([pk]), cache)).sum()
    torch.testing.assert_close(score(10, 3), score(40, 33), atol=1e-4, rtol=1e-4)


def _setup(t: int, h: int, dtype: torch.dtype, cache_dtype: torch.dtype, pos_dtype: torch.dtype, device: str):
    """q [T, H, 192] with q_pe its tail; kv_a [T, L + R + 8] holding kv_c and k_pe views; strided positions/slots."""
    q = torch.randn(t, h, NOPE + R, dtype=dtype, device=device)
    kv_a = torch.randn(t, L + R + 8, dtype=dtype, device=device)
    cache_tab, _ = _cos_sin(3 * t + 50, R, mscale=1.2, device=device)
    pos = torch.randint(0, 3 * t + 50, (2 * t,), dtype=pos_dtype, device=device)[::2]
    num_slots = 3 * t + 5
    slots = torch.randperm(num_slots, device=device)[: 2 * t][::2]
    kv_cache = torch.full((num_slots, L + R), 7.0, device=device).to(cache_dtype)   # sentinel rows
    return q, kv_a, pos, cache_tab, slots, kv_cache


def _run(fn, q, kv_a, pos, cache_tab, slots, kv_cache, kv_scale) -> None:
    fn(q[..., NOPE:], kv_a[:, L:L + R], kv_a[:, :L], pos, cache_tab, kv_cache, slots, kv_scale=kv_scale)


def _check_cache(out: torch.Tensor, ref: torch.Tensor, scale: float, dtype: torch.dtype) -> None:
    if out.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        # Values computed within TOL[dtype] may land one fp8 step apart: 2^-3 relative (e4m3) + subnormal step.
        a, b = out.float() * scale, ref.float() * scale
        assert ((a - b).abs() <= b.abs() * 2**-3 * 1.01 + 2**-9 * scale).all()
    else:
        torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype,cache_kind", [
    (torch.float32, "same"), (torch.float16, "same"), (torch.float16, "e4m3"), (torch.float16, "e4m3_tensor"),
    (torch.float32, "e4m3"),
    pytest.param(torch.bfloat16, "same", marks=pytest.mark.gpu),
    pytest.param(torch.bfloat16, "e4m3", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("t,h,pos_dtype", [(1, 5, torch.int64), (37, 20, torch.int32)])
def test_mla_rope_kv_store_matches_ref(t: int, h: int, pos_dtype: torch.dtype, dtype: torch.dtype,
                                       cache_kind: str, device: str) -> None:
    cache_dtype = dtype if cache_kind == "same" else torch.float8_e4m3fn
    scale = None if cache_kind == "same" else 0.25
    q, kv_a, pos, cache_tab, slots, kv_cache = _setup(t, h, dtype, cache_dtype, pos_dtype, device)
    q_ref, kv_a_ref, kv_cache_ref = q.clone(), kv_a.clone(), kv_cache.clone()
    kv_scale = torch.tensor([scale], device=device) if cache_kind == "e4m3_tensor" else scale
    _run(mla_rope_kv_store, q, kv_a, pos, cache_tab, slots, kv_cache, kv_scale)
    _run(mla_rope_kv_store_ref, q_ref, kv_a_ref, pos, cache_tab, slots, kv_cache_ref, scale)
    tol = TOL[dtype]
    torch.testing.assert_close(q, q_ref, atol=tol, rtol=tol)              # q_pe rotated in place, q_nope intact
    torch.testing.assert_close(kv_a, kv_a_ref, atol=tol, rtol=tol)        # k_pe rotated in place, kv_c intact
    _check_cache(kv_cache, kv_cache_ref, scale or 1.0, dtype)
    untouched = torch.ones(kv_cache.shape[0], dtype=torch.bool, device=device)
    untouched[slots.long()] = False
    assert (kv_cache[untouched].float() == 7.0).all(), "rows outside out_slots must not change"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16,
                                   pytest.param(torch.bfloat16, marks=pytest.mark.gpu)])
def test_kv_a_layernorm_fused_in_place(dtype: torch.dtype, device: str) -> None:
    # norm_weight: kv_c arrives raw, is RMS-normalised in place (the extend path reads it) and cached normalised
    t, h = 13, 4
    q, kv_a, pos, cache_tab, slots, kv_cache = _setup(t, h, dtype, dtype, torch.int64, device)
    kv_a[:, :L] *= 3.0
    w = (torch.rand(L, device=device) + 0.5).to(dtype)
    q_ref, kv_a_ref, kv_cache_ref, raw = q.clone(), kv_a.clone(), kv_cache.clone(), kv_a[:, :L].clone()
    for fn, qq, kv, cache in ((mla_rope_kv_store, q, kv_a, kv_cache),
                              (mla_rope_kv_store_ref, q_ref, kv_a_ref, kv_cache_ref)):
        fn(qq[..., NOPE:], kv[:, L:L + R], kv[:, :L], pos, cache_tab, cache, slots, norm_weight=w, eps=1e-6)
    tol = TOL[dtype]
    torch.testing.assert_close(kv_a, kv_a_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(kv_cache, kv_cache_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(q, q_ref, atol=tol, rtol=tol)
    torch.testing.assert_close(kv_a[:, :L], rmsnorm_ref(raw, w, 1e-6), atol=tol, rtol=tol)   # the model's RMSNorm
    assert (kv_a[:, L + R:] == kv_a_ref[:, L + R:]).all()                  # the padding columns untouched


@pytest.mark.parametrize("r", [8, 24])
def test_rope_dims_that_are_not_twice_a_power_of_two(r: int, device: str) -> None:
    # rope 8 (the small test configs) and 24 (12 pairs: the pair tile is padded to 16 and masked)
    t, h, nope, big_l = 9, 3, 16, 32
    q = torch.randn(t, h, nope + r, device=device)
    kv_a = torch.randn(t, big_l + r, device=device)
    cache_tab, _ = _cos_sin(64, r, mscale=1.1, device=device)
    pos = torch.randint(0, 64, (t,), device=device)
    slots = torch.randperm(t + 4, device=device)[:t]
    caches = [torch.full((t + 4, big_l + r), 7.0, device=device) for _ in range(2)]
    qs, kvs = [q, q.clone()], [kv_a, kv_a.clone()]
    for fn, qq, kv, cache in zip((mla_rope_kv_store, mla_rope_kv_store_ref), qs, kvs, caches):
        fn(qq[..., nope:], kv[:, big_l:], kv[:, :big_l], pos, cache_tab, cache, slots)
    tol = TOL[torch.float32]
    for got, want in zip((qs[0], kvs[0], caches[0]), (qs[1], kvs[1], caches[1])):
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)


def test_launcher_rejects_bad_inputs() -> None:
    q, kv_a, pos, cache_tab, slots, kv_cache = _setup(3, 2, torch.float16, torch.float16, torch.int64, "cpu")
    with pytest.raises(AssertionError, match="only to an fp8 cache"):
        _run(mla_rope_kv_store, q, kv_a, pos, cache_tab, slots, kv_cache, 0.5)
    with pytest.raises(AssertionError, match="kv_cache must be"):
        _run(mla_rope_kv_store, q, kv_a, pos, cache_tab, slots, kv_cache[:, :-1], None)
    with pytest.raises(AssertionError, match="q_pe last dim"):
        q_pe = torch.randn(3, 2, 2 * R, dtype=torch.float16)[..., ::2]
        mla_rope_kv_store(q_pe, kv_a[:, L:L + R], kv_a[:, :L], pos, cache_tab, kv_cache, slots)


def test_bench_byte_counts() -> None:
    # One token, 128 heads: q_pe 128 x 64 bf16 and k_pe read + written, 512 latent read, 576 bf16 row written.
    expect = 2 * 129 * 64 * 2 + 512 * 2 + 576 * 2 + 16 + 64 * 4
    assert small_ops.rope_kv_bytes(1, 128) == expect
    assert small_ops.rope_kv_bytes(1, 128, cache_elt=1) == expect - 576
    assert small_ops.kv_store_bytes(2) == 2 * (576 * 2 + 576 * 2 + 8)
    assert small_ops.rope_flops(1, 127) == 3 * 128 * 64
