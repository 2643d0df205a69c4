"""The kernel switch's entries for inputs quantised ahead (`QuantPlan`): the PyTorch references against the Triton
launchers (the interpreter on the CPU), in both layouts."""
from __future__ import annotations

import pytest
import torch

from mlaserve.kernels.fp8_gemm import QuantPlan
from mlaserve.kernels.quant import block_quant_fp8_ref
from mlaserve.layers.ops import get_ops


def _dequant(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return q.float() * s.repeat_interleave(128, dim=1)


@pytest.mark.parametrize("plan", [QuantPlan(False, 20), QuantPlan(True, 24)])
def test_quantised_entries_match_their_references(plan: QuantPlan, device: str) -> None:
    seed = torch.seed()
    print(f"seed {seed}")
    tri, ref = get_ops("triton"), get_ops("torch")
    t, d = 20, 512                                       # K: whole 4 x 128 groups, as cuBLAS's layout wants
    x = torch.randn(t, d, device=device)
    w = torch.rand(d, device=device) + 0.5
    res_t = torch.randn(t, d, device=device)
    res_r = res_t.clone()
    q_t, s_t = tri.rmsnorm_quant(x, w, 1e-6, res_t, plan)
    q_r, s_r = ref.rmsnorm_quant(x, w, 1e-6, res_r, plan)
    assert q_t.shape == q_r.shape == (plan.rows, d) and s_t.stride() == s_r.stride()
    torch.testing.assert_close(res_t, res_r, atol=1e-5, rtol=1e-5)                 # both update it in place
    torch.testing.assert_close(s_t, s_r, atol=0, rtol=1e-5)
    # codes at most one e4m3 step apart (fp32 sums in another order can move a value across a rounding edge)
    deq_t, deq_r = _dequant(q_t, s_t), _dequant(q_r, s_r)
    assert ((deq_t - deq_r).abs() <= deq_r.abs() * 2**-3 * 1.01 + 2**-9 * s_r.max()).all()
    assert (deq_t[t:] == 0).all() and (deq_r[t:] == 0).all()
    gu = torch.randn(t, 2 * d, device=device)
    a_t, a_r = tri.silu_and_mul_quant(gu, plan), ref.silu_and_mul_quant(gu, plan)
    torch.testing.assert_close(a_t[1], a_r[1], atol=0, rtol=1e-5)
    w_q, w_s = block_quant_fp8_ref(torch.randn(64, d, device=device) * 0.05)
    assert ref.fp8_quant_plan(t, x, w_q) is None          # the reference kernels quantise nothing ahead
    if plan.scale_m_major and device != "cuda":
        return                                              # cuBLAS's layout: its GEMM runs on the GPU only
    y_t = tri.fp8_linear_quantized(q_r, s_r, t, plan, w_q, w_s, None, torch.float32)
    y_r = ref.fp8_linear_quantized(q_r, s_r, t, plan, w_q, w_s, None, torch.float32)
    assert y_t.shape == (t, 64)
    torch.testing.assert_close(y_t, y_r, atol=2e-3 * y_r.abs().max().item(), rtol=0)


@pytest.mark.parametrize("t", [3, 20, 130])
def test_swiglu_fp8_is_the_unfused_composition(t: int, device: str) -> None:
    """The dense MLP's and the dense shared experts' down GEMM: with the activation quantising ahead (20 and 130
    rows: the Triton GEMM's layout on the CPU, cuBLAS's from 128 rows on an H100 / H200) or not (3 rows: the
    gemv), the output of silu_and_mul then fp8_linear, bit for bit."""
    from mlaserve.layers.moe import swiglu_fp8
    seed = torch.seed()
    print(f"seed {seed}")
    ops = get_ops("triton")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gu = torch.randn(t, 2 * 512, device=device, dtype=dtype)
    w_q, w_s = block_quant_fp8_ref(torch.randn(256, 512, device=device) * 0.05)
    bias = torch.randn(256, device=device, dtype=dtype)
    y = swiglu_fp8(ops, gu, w_q, w_s, bias)
    assert (ops.fp8_quant_plan(t, gu, w_q) is None) == (t == 3)
    assert y.shape == (t, 256) and torch.equal(y, ops.fp8_linear(ops.silu_and_mul(gu), w_q, w_s) + bias)
