"""gemv (the decode-size linear; Triton, CPU interpreter here) against F.linear."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mlaserve.kernels import gemv as gemv_mod
from mlaserve.kernels.gemv import GEMV1_MAX_K, MAX_M, bucket_rows, cublas_linear, gemv, gemv1

TOL = {torch.float32: 1e-4, torch.float16: 2e-2}


@pytest.mark.parametrize("m,n,k", [(1, 100, 64), (5, 1000, 300), (MAX_M, 48, 512)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16,
                                   pytest.param(torch.bfloat16, marks=pytest.mark.gpu)])
def test_gemv_matches_linear(device: str, m: int, n: int, k: int, dtype: torch.dtype) -> None:
    x = torch.randn(m + 2, k, device=device).to(dtype)[1:m + 1]               # a row slice: strided rows
    w = (torch.randn(n, k, device=device) / k ** 0.5).to(dtype)
    bias = torch.randn(n, device=device).to(dtype) if n == 100 else None
    got = gemv(x, w, bias)
    want = F.linear(x.float(), w.float(), None if bias is None else bias.float())
    tol = TOL.get(dtype, 3e-2)
    assert got.shape == (m, n) and got.dtype == dtype
    assert (got.float() - want).abs().max().item() <= tol


@pytest.mark.parametrize("n,k", [(100, 64), (1000, 300), (48, 2048), (7, GEMV1_MAX_K)])   # K, N not powers of 2
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16,
                                   pytest.param(torch.bfloat16, marks=pytest.mark.gpu)])
def test_gemv1_matches_linear(device: str, n: int, k: int, dtype: torch.dtype) -> None:
    seed = torch.seed()
    print("seed", seed)
    x = torch.randn(3, k, device=device).to(dtype)[1:2]                       # one row of a wider tensor
    w = (torch.randn(n + 3, k, device=device) / k ** 0.5).to(dtype)[:n]
    bias = torch.randn(n, device=device).to(dtype) if n == 100 else None
    got = gemv1(x, w, bias)
    want = F.linear(x.float(), w.float(), None if bias is None else bias.float())
    assert got.shape == (1, n) and got.dtype == dtype
    assert (got.float() - want).abs().max().item() <= TOL.get(dtype, 3e-2)


def test_gemv1_rejects_what_it_cannot_hold(device: str) -> None:
    with pytest.raises(AssertionError, match="K up to"):
        gemv1(torch.randn(1, GEMV1_MAX_K + 1, device=device), torch.randn(4, GEMV1_MAX_K + 1, device=device))
    with pytest.raises(AssertionError, match=r"x \[1, K\]"):
        gemv1(torch.randn(2, 8, device=device), torch.randn(4, 8, device=device))


def test_gemv1_switch(monkeypatch) -> None:
    monkeypatch.setenv("MLASERVE_GEMV1", "0")
    assert not gemv_mod.gemv1_enabled()
    monkeypatch.setenv("MLASERVE_GEMV1", "1")
    assert gemv_mod.gemv1_enabled()
    monkeypatch.setenv("MLASERVE_GEMV1", "yes")
    with pytest.raises(ValueError, match="MLASERVE_GEMV1='yes': expected 0 or 1"):
        gemv_mod.gemv1_enabled()


def test_gemv_rejects_more_rows(device: str) -> None:
    with pytest.raises(AssertionError, match="at most"):
        gemv(torch.randn(MAX_M + 1, 8, device=device), torch.randn(4, 8, device=device))


def test_bucket_rows_are_few_and_waste_at_most_a_quarter() -> None:
    buckets = {bucket_rows(m) for m in range(1, 16385)}
    assert all(bucket_rows(m) == m for m in range(1, 17))
    assert all(m <= bucket_rows(m) <= max(m + 15, m * 5 // 4) for m in range(1, 16385))
    assert all(bucket_rows(b) == b for b in buckets)          # a bucket is its own bucket
    assert len(buckets - set(range(1, 17))) <= 50, sorted(buckets)


@pytest.mark.parametrize("m", [17, 100, 300, 513])
def test_padded_cublas_linear_equals_linear(m: int) -> None:
    seed = torch.seed()
    print("seed", seed)
    x, w, b = torch.randn(m, 48, dtype=torch.float64), torch.randn(40, 48, dtype=torch.float64), torch.randn(40, dtype=torch.float64)
    y = cublas_linear(x, w, b, pad=True)
    assert y.shape == (m, 40) and y.is_contiguous()
    torch.testing.assert_close(y, F.linear(x, w, b), rtol=0, atol=1e-12)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="out_dtype runs torch.mm's CUDA dtype overload")
@pytest.mark.parametrize("m", [300, 4096])
def test_cublas_linear_fp32_out_of_bf16_is_the_fp32_gemm(m: int) -> None:
    """bf16 operands, fp32 output (the MoE router's logits): the fp32 GEMM of the upcast operands up to summation
    order, padded rows or not."""
    seed = torch.seed()
    print("seed", seed)
    x = torch.randn(m, 7168, device="cuda").to(torch.bfloat16)
    w = (torch.randn(256, 7168, device="cuda") * 0.02).to(torch.bfloat16)
    ref = x.double() @ w.double().t()
    for pad in (False, True):
        y = cublas_linear(x, w, pad=pad, out_dtype=torch.float32)
        assert y.dtype == torch.float32 and y.shape == (m, 256)
        assert ((y.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5
