"""head_gemm, rope_head_gemm and merge_head_gemm (the absorbed-MLA per-head GEMMs; Triton, CPU interpreter here)
against their references."""
from __future__ import annotations

import math

import pytest
import torch

from mlaserve.kernels.mla_absorb import (head_gemm, head_gemm_ref, merge_head_gemm, merge_head_gemm_ref, rope_head_gemm,
                                         rope_head_gemm_ref)

TOL = {torch.float32: 1e-4, torch.float16: 2e-2}


@pytest.mark.parametrize("t", [1, 5, 70])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_absorb_query_from_a_strided_view(device: str, t: int, dtype: torch.dtype) -> None:
    # q_nope is q[..., :Dn] of the projected q [T, H, Dn + R]; w_kc [H, Dn, L] as stored
    h, dn, r, big_l = 4, 24, 8, 80
    q = torch.randn(t, h, dn + r, device=device).to(dtype)
    w_kc = (torch.randn(h, dn, big_l, device=device) / dn ** 0.5).to(dtype)
    got = head_gemm(q[..., :dn], w_kc)
    want = head_gemm_ref(q[..., :dn].float(), w_kc.float())
    assert got.shape == (t, h, big_l) and got.dtype == dtype
    assert (got.float() - want).abs().max().item() <= TOL[dtype]


@pytest.mark.parametrize("t", [1, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_apply_value_weight_transposed_into_a_buffer(device: str, t: int, dtype: torch.dtype) -> None:
    # o = o_lat @ w_vc[h]^T with w_vc [H, Dv, L] as stored; written into a view of a wider buffer
    h, dv, big_l = 3, 40, 144
    o_lat = torch.randn(t, h, big_l, device=device).to(dtype)
    w_vc = (torch.randn(h, dv, big_l, device=device) / big_l ** 0.5).to(dtype)
    buf = torch.full((t, h, dv + 8), float("nan"), device=device, dtype=dtype)
    got = head_gemm(o_lat, w_vc, trans=True, out=buf[..., 4:4 + dv])
    assert got.data_ptr() == buf[..., 4:].data_ptr()
    want = head_gemm_ref(o_lat.float(), w_vc.float(), trans=True)
    assert (got.float() - want).abs().max().item() <= TOL[dtype]
    assert torch.isnan(buf[..., :4]).all() and torch.isnan(buf[..., 4 + dv:]).all()     # nothing else written


def test_shapes_are_checked(device: str) -> None:
    with pytest.raises(AssertionError, match="does not match"):
        head_gemm(torch.randn(2, 3, 8, device=device), torch.randn(3, 9, 4, device=device))
    assert head_gemm(torch.randn(0, 3, 8, device=device), torch.randn(3, 8, 4, device=device)).shape == (0, 3, 4)


@pytest.mark.parametrize("t,h", [(1, 16), (5, 24)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rope_head_gemm_is_both_launches(device: str, t: int, h: int, dtype: torch.dtype) -> None:
    """W_UK's GEMM and the rope + cache write in one launch: the GEMM's output and every in-place effect of the
    rope (q_pe, k_pe, the normed kv_c, the cache rows) as the two references give them (24 heads: two rope head
    blocks per token)."""
    seed = torch.seed()
    print("seed", seed)
    dn, r, big_l, slots = 24, 8, 32, 40
    q = torch.randn(t, h, dn + r, device=device).to(dtype)
    w_kc = (torch.randn(h, dn, big_l, device=device) / dn ** 0.5).to(dtype)
    latent = torch.randn(t, big_l + r, device=device).to(dtype)
    ang = torch.arange(64, device=device)[:, None].float() * torch.rand(r // 2, device=device)[None, :]
    cos_sin = torch.cat([ang.cos(), ang.sin()], dim=1).contiguous()
    positions = torch.randint(0, 64, (t,), device=device)
    cache = torch.zeros(slots, big_l + r, device=device, dtype=dtype)
    out_slots = torch.randperm(slots, device=device)[:t]
    norm_w = (torch.rand(big_l, device=device) + 0.5).to(dtype)

    def run(fn):
        qq, lat, kv = q.clone(), latent.clone(), cache.clone()
        got = fn(qq[..., :dn], w_kc, qq[..., dn:], lat[:, big_l:], lat[:, :big_l], positions, cos_sin, kv, out_slots,
                 norm_weight=norm_w, eps=1e-6)
        return got, qq, lat, kv
    got, want = run(rope_head_gemm), run(rope_head_gemm_ref)
    assert (got[0].float() - want[0].float()).abs().max().item() <= TOL[dtype]
    for a, b in zip(got[1:], want[1:]):                          # q (rope part roped), latent, cache
        torch.testing.assert_close(a, b, atol=TOL[dtype] / 10, rtol=TOL[dtype] / 10)
    assert torch.equal(got[1][..., :dn], q[..., :dn])            # the GEMM's input columns untouched


@pytest.mark.parametrize("lens,splits", [([1, 131, 70], 7), ([300], 16), ([5, 9], 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_merge_head_gemm_is_the_reduce_then_w_uv(device: str, lens: list[int], splits: int,
                                                 dtype: torch.dtype) -> None:
    """W_UV's GEMM reading mla_decode's split partials (some splits empty: their rows never written) gives what the
    reduce launch and then head_gemm give, and its reference's result."""
    from mlaserve.kernels.mla_decode import mla_decode, mla_decode_parts
    from test_mla_decode import make_case            # (tests/kernels is on the path: pytest prepends it)

    seed = torch.seed()
    print("seed", seed)
    args = make_case(device, lens, heads=16, big_l=64, rope=16, num_q=1, dtype=dtype, kv_dtype=dtype)
    w_vc = (torch.randn(16, 40, 64, device=device) / 8).to(dtype)          # [H, Dv, L]
    parts = mla_decode_parts(**args, num_kv_splits=splits)
    assert parts.out is None and parts.mid_o.shape == (len(lens), 16, splits, 64)
    got = merge_head_gemm(parts.mid_o, parts.mid_lse, w_vc)
    two_launches = head_gemm(mla_decode(**args, num_kv_splits=splits), w_vc, trans=True)
    ref = merge_head_gemm_ref(parts.mid_o, parts.mid_lse, w_vc)
    assert got.shape == (len(lens), 16, 40) and got.dtype == dtype and torch.isfinite(got).all()
    tol = TOL[dtype] / 10 if dtype == torch.float32 else TOL[dtype]
    assert (got.float() - two_launches.float()).abs().max().item() <= tol
    assert (got.float() - ref.float()).abs().max().item() <= tol
    one = mla_decode_parts(**args, num_kv_splits=1)
    assert one.mid_o is None and torch.equal(one.out, mla_decode(**args, num_kv_splits=1))


def test_merge_head_gemm_skips_empty_splits_and_padding_rows(device: str) -> None:
    """Garbage (NaN) in an empty split's rows is never read; a row whose splits are all empty gives zeros."""
    t, h, s, k, n = 3, 2, 5, 32, 16
    mid_o = torch.randn(t, h, s, k, device=device)
    lse = torch.randn(t, h, s, device=device) * 3
    lse[0, :, 2:] = float("-inf")
    mid_o[0, :, 2:] = float("nan")
    lse[2] = float("-inf")
    mid_o[2] = float("nan")
    w = torch.randn(h, n, k, device=device)
    got = merge_head_gemm(mid_o, lse, w)
    torch.testing.assert_close(got, merge_head_gemm_ref(mid_o, lse, w), atol=1e-4, rtol=1e-4)
    assert torch.equal(got[2], torch.zeros(h, n, device=device))
    merged = (torch.softmax(lse[1] * math.log(2), dim=-1)[..., None] * mid_o[1]).sum(dim=1)   # [H, K]
    torch.testing.assert_close(got[1], torch.einsum("hk,hnk->hn", merged, w), atol=1e-4, rtol=1e-4)
