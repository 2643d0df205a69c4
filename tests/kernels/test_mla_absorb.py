"""head_gemm (the absorbed-MLA per-head GEMMs; Triton, CPU interpreter here) against head_gemm_ref."""
from __future__ import annotations

import pytest
import torch

from mlaserve.kernels.mla_absorb import head_gemm, head_gemm_ref, rope_head_gemm, rope_head_gemm_ref

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
