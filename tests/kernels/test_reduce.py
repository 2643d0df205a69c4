"""sum_dim1 (Triton; interpreter on CPU) vs its reference at the fused-MoE combine and split-K shapes."""
from __future__ import annotations

import random

import pytest
import torch

from mlaserve.kernels.reduce import sum_dim1, sum_dim1_ref

DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("a,b,c,rows", [(1, 8, 2048, False), (5, 9, 7168, False), (3, 6, 100, False),
                                        (1, 3, 64 * 2112, False), (37, 8, 2048, True), (20, 9, 300, True),
                                        (3, 70, 64, True)])
def test_sum_dim1_matches_ref(a: int, b: int, c: int, rows: bool, dtype: torch.dtype, device: str) -> None:
    """fp32 accumulation rounded once: equal to the reference up to fp32 summation order. rows: the row-blocked
    kernel (prefill sizes), A and C not multiples of its tile, and B past the one-tile kernel's 64."""
    seed = random.randrange(2**31)
    print(f"seed {seed}")
    torch.manual_seed(seed)
    x = torch.randn(a, b, c, device=device).to(dtype)
    out = torch.full((a, c), float("nan"), dtype=dtype, device=device)
    got = sum_dim1(x, out=out, rows=rows)
    assert got.data_ptr() == out.data_ptr()
    want = sum_dim1_ref(x)
    ulp = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=ulp, atol=ulp * b ** 0.5)


@pytest.mark.parametrize("rows", [False, True])
def test_sum_dim1_fp32_in_bf16_out_and_strided_rows(rows: bool, device: str) -> None:
    x = torch.randn(4, 5, 300, device=device)[:, :, :256]                  # row stride 300
    out = torch.empty(4, 256, dtype=torch.bfloat16, device=device)
    got = sum_dim1(x, out=out, rows=rows)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got, x.sum(1).to(torch.bfloat16), rtol=8e-3, atol=1e-2)   # one bf16 rounding
