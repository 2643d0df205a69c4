"""RMSNorm kernels (plain, + residual add, + fp8 quant) vs their references, and the references vs HF."""
from __future__ import annotations

import pytest
import torch

from mlaserve.bench.kernel_cases import small_ops
from mlaserve.kernels.norm import (fused_add_rmsnorm, fused_add_rmsnorm_ref, rmsnorm, rmsnorm_quant_fp8,
                                   rmsnorm_quant_fp8_ref, rmsnorm_ref)

# Tolerances (abs = rel): fp32 1e-5 (sum order, rsqrt); fp16 2e-3 (~2 ulp); bf16 1.6e-2 (~2 ulp, GPU only).
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]
SHAPES = [(1, 96), (37, 200)]     # T = 1 and an odd T; D not a power of two
EPS = 1e-6


def _inputs(t: int, d: int, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] as a row-strided view (like kv_c inside kv_a_proj output), weight around 1 like trained norms."""
    x = torch.randn(t, d + 24, dtype=dtype, device=device)[:, 8:8 + d] * 3
    return x, (torch.rand(d, device=device) + 0.5).to(dtype)


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    tol = TOL[ref.dtype]
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


def _dequant(q: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    return q.float() * scale.repeat_interleave(group, dim=1)[:, : q.shape[1]]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,d", SHAPES)
def test_rmsnorm_matches_ref(t: int, d: int, dtype: torch.dtype, device: str) -> None:
    x, w = _inputs(t, d, dtype, device)
    out = rmsnorm(x, w, EPS)
    assert out.shape == (t, d) and out.dtype == dtype
    _close(out, rmsnorm_ref(x, w, EPS))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_ref_matches_hf(dtype: torch.dtype) -> None:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm
    hf = DeepseekV3RMSNorm(200, eps=EPS).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(torch.rand(200) + 0.5)
        x = torch.randn(7, 200, dtype=dtype) * 3
        # Same ops in the same order: bit-identical in both dtypes.
        torch.testing.assert_close(rmsnorm_ref(x, hf.weight, EPS), hf(x), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,d", SHAPES)
def test_fused_add_rmsnorm_matches_ref_and_updates_residual(t: int, d: int, dtype: torch.dtype,
                                                           device: str) -> None:
    x, w = _inputs(t, d, dtype, device)
    residual = torch.randn(t, d, dtype=dtype, device=device)
    x_before, res_before = x.clone(), residual.clone()
    out, res_out = fused_add_rmsnorm(x, residual, w, EPS)
    ref_out, ref_res = fused_add_rmsnorm_ref(x_before, res_before, w, EPS)
    _close(res_out, ref_res)
    _close(out, ref_out)
    assert res_out.data_ptr() == residual.data_ptr(), "residual_out must be the residual buffer (in place)"
    assert torch.equal(x, x_before), "x must not be modified"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("t,d,group", [(1, 96, 128), (37, 200, 128), (5, 200, 64)])
def test_rmsnorm_quant_fp8_matches_ref(t: int, d: int, group: int, dtype: torch.dtype, device: str) -> None:
    x, w = _inputs(t, d, dtype, device)
    x[0, :] = 0                                           # an all-zero row must give zeros, not NaN
    x_q, scale = rmsnorm_quant_fp8(x, w, EPS, group)
    ref_q, ref_scale = rmsnorm_quant_fp8_ref(x, w, EPS, group)
    assert x_q.dtype == torch.float8_e4m3fn and x_q.shape == (t, d)
    assert scale.dtype == torch.float32 and scale.shape == (t, -(-d // group))
    # scale = amax / 448 of the normalised row: as close as the norm output itself.
    torch.testing.assert_close(scale, ref_scale, atol=0, rtol=TOL[dtype])
    deq, ref_deq = _dequant(x_q, scale, group), _dequant(ref_q, ref_scale, group)
    assert torch.isfinite(deq).all() and (deq[0] == 0).all()
    # At most one e4m3 step apart (2^-3 relative; subnormal step 2^-9 * scale).
    step = ref_deq.abs() * 2**-3 + 2**-9 * ref_scale.repeat_interleave(group, dim=1)[:, :d]
    assert ((deq - ref_deq).abs() <= step * 1.01).all()
    # And what a user sees: within fp8 rounding (2^-4 relative, + margin) of the unquantised norm.
    norm = rmsnorm_ref(x, w, EPS).float()
    assert ((deq - norm).abs() <= norm.abs() * 0.07 + 2**-9 * scale.max()).all()


def test_launcher_rejects_bad_inputs() -> None:
    x, w = torch.randn(4, 96), torch.ones(96)
    with pytest.raises(AssertionError, match="weight"):
        rmsnorm(x, torch.ones(95), EPS)
    with pytest.raises(AssertionError, match="contiguous"):
        rmsnorm(x.t(), torch.ones(4), EPS)
    with pytest.raises(AssertionError, match="residual"):
        fused_add_rmsnorm(x, torch.randn(4, 96, dtype=torch.float16), w, EPS)


def test_bench_byte_counts() -> None:
    # V3 decode step: 1 token x 7168 bf16 = 14336 B in and out, plus the weight.
    assert small_ops.norm_bytes(1, 7168) == 3 * 14336
    assert small_ops.norm_bytes(1, 7168, residual=True) == 5 * 14336
    assert small_ops.norm_bytes(2, 200, quant=True) == 2 * 200 * 2 + 400 + 2 * 200 + 2 * 2 * 4
    assert small_ops.norm_flops(3, 10) == 120


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("m_major,pad", [(False, 0), (True, 3)])
def test_rmsnorm_quant_fp8_is_the_quant_pass_of_the_norm(residual: bool, m_major: bool, pad: int,
                                                         device: str) -> None:
    # What an FP8 linear reads: the same codes and scales as per_token_group_quant_fp8 over the norm's output, in
    # its layout (cuBLAS's M-major scales over rows padded with quantised zeros), the residual updated as the norm's.
    from mlaserve.kernels.quant import per_token_group_quant_fp8
    seed = torch.seed()
    print(f"seed {seed}")
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    t, d = 37, 512
    x, w = _inputs(t, d, dtype, device)
    res = torch.randn(t, d, dtype=dtype, device=device) if residual else None
    rows = t + pad
    if residual:
        res_ref = res.clone()
        y, _ = fused_add_rmsnorm(x, res_ref, w, EPS)
    else:
        y = rmsnorm(x, w, EPS)
    ref_q, ref_s = per_token_group_quant_fp8(y, 128, scale_m_major=m_major, out_rows=rows)
    x_q, scale = rmsnorm_quant_fp8(x, w, EPS, 128, res, scale_m_major=m_major, out_rows=rows)
    assert x_q.shape == (rows, d) and scale.shape == (rows, d // 128) and scale.stride() == ref_s.stride()
    assert torch.equal(x_q.view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(scale, ref_s)
    if residual:
        assert torch.equal(res, res_ref)
