"""per_token_group_quant_fp8 (Triton; interpreter on CPU) against per_token_group_quant_fp8_ref."""
from __future__ import annotations

import pytest
import torch

from mlaserve.kernels.quant import per_token_group_quant_fp8, per_token_group_quant_fp8_ref

# Dequantised error bound per element, relative to the amax of its group: half a grid step at the top
# binade, i.e. 2^-(mantissa bits + 1): e4m3 -> 1/16, e5m2 -> 1/8.
DEQ_TOL = {torch.float8_e4m3fn: 1 / 16, torch.float8_e5m2: 1 / 8}


def _dequant_err(x: torch.Tensor, x_q: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """max over elements of |x - x_q * scale| / amax(group of the element)."""
    m, k = x.shape
    g = scale.shape[1]
    pad = g * group - k
    xf = torch.nn.functional.pad(x.float(), (0, pad)).view(m, g, group)
    deq = torch.nn.functional.pad(x_q.float(), (0, pad)).view(m, g, group) * scale[..., None]
    amax = xf.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    return ((deq - xf).abs() / amax).max()


def _check(x: torch.Tensor, group: int, dtype: torch.dtype) -> None:
    x_q, scale = per_token_group_quant_fp8(x, group, dtype)
    x_qr, scale_r = per_token_group_quant_fp8_ref(x, group, dtype)
    assert x_q.dtype == dtype and x_q.shape == x.shape and x_q.is_contiguous()
    assert scale.dtype == torch.float32 and scale.shape == scale_r.shape
    torch.testing.assert_close(scale, scale_r, rtol=1e-6, atol=0)      # amax / fp8_max: same fp32 ops
    assert _dequant_err(x, x_q, scale, group) <= DEQ_TOL[dtype]
    # Same rounding as the reference (nearest even): allow a rare 1-code difference from GPU division.
    same = (x_q.view(torch.uint8) == x_qr.view(torch.uint8)).float().mean()
    assert same >= 0.999, f"only {same:.4f} of the fp8 codes match the reference"


@pytest.mark.parametrize("k", [256, 300])                              # multiple of 128 and not
@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_quant_matches_ref(device: str, k: int, dtype: torch.dtype) -> None:
    m = 9
    # rows of very different magnitude: every group must pick its own scale
    x = torch.randn(m, k, device=device) * torch.logspace(-3, 3, m, device=device)[:, None]
    _check(x.to(torch.bfloat16), 128, dtype)


@pytest.mark.parametrize("x_dtype", [torch.float16, torch.float32])
def test_quant_strided_input_and_small_groups(device: str, x_dtype: torch.dtype) -> None:
    base = torch.randn(5, 400, device=device, dtype=x_dtype) * 30
    x = base[:, 7:207]                                                 # [5, 200], row stride 400
    _check(x, 64, torch.float8_e4m3fn)
    _check(x, 48, torch.float8_e4m3fn)                                 # group not a power of two


def test_quant_zero_and_saturating_groups(device: str) -> None:
    x = torch.randn(3, 256, device=device)
    x[0, :128] = 0.0                                                   # an all-zero group
    x[1, 130] = 1e4                                                    # an outlier owns its group's scale
    x_q, scale = per_token_group_quant_fp8(x)
    assert torch.isfinite(scale).all() and (scale > 0).all()
    assert (x_q[0, :128].float() == 0).all()
    assert x_q[1, 130].float() == 448.0                                # amax maps to the e4m3 max exactly
    assert torch.isfinite(x_q.float()).all()
    _check(x, 128, torch.float8_e4m3fn)


def test_quant_scale_m_major(device: str) -> None:
    """scale_m_major: the same codes and scales, the scale stored M-major (strides (1, M)) as cuBLAS reads it."""
    x = torch.randn(6, 384, device=device, dtype=torch.float16) * 3
    x_q, scale = per_token_group_quant_fp8(x)
    x_qm, scale_m = per_token_group_quant_fp8(x, scale_m_major=True)
    assert scale_m.shape == (6, 3) and scale_m.stride() == (1, 6)
    assert torch.equal(x_qm.view(torch.uint8), x_q.view(torch.uint8)) and torch.equal(scale_m, scale)
    x_qp, scale_p = per_token_group_quant_fp8(x, scale_m_major=True, out_rows=8)      # 6 rows -> 8, the 2 extra zeros
    assert x_qp.shape == (8, 384) and scale_p.shape == (8, 3) and scale_p.stride() == (1, 8)
    assert torch.equal(x_qp[:6].view(torch.uint8), x_q.view(torch.uint8)) and torch.equal(scale_p[:6], scale)
    _, scale_zero = per_token_group_quant_fp8_ref(torch.zeros(2, 384, device=device))
    assert (x_qp[6:].float() == 0).all() and torch.equal(scale_p[6:], scale_zero)
