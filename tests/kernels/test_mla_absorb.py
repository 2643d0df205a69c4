"""head_gemm (the absorbed-MLA per-head GEMMs; Triton, CPU interpreter here) against head_gemm_ref."""
from __future__ import annotations

import pytest
import torch

from mlaserve.kernels.mla_absorb import head_gemm, head_gemm_ref

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
