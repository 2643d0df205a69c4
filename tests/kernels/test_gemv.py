"""gemv (the decode-size linear; Triton, CPU interpreter here) against F.linear."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mlaserve.kernels.gemv import MAX_M, gemv

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


def test_gemv_rejects_more_rows(device: str) -> None:
    with pytest.raises(AssertionError, match="at most"):
        gemv(torch.randn(MAX_M + 1, 8, device=device), torch.randn(4, 8, device=device))
