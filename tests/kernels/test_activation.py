"""SiLU-and-mul (+ fp8 quant) kernels vs their references, and the reference vs the HF DeepSeek MLP activation."""
from __future__ import annotations

import pytest
import torch

from mlaserve.bench.kernel_cases import small_ops
from mlaserve.kernels.activation import (silu_and_mul, silu_and_mul_quant_fp8, silu_and_mul_quant_fp8_ref,
                                         silu_and_mul_ref)

# Tolerances (abs = rel): fp32 1e-5 (exp implementations); fp16 2e-3 (~2 ulp); bf16 1.6e-2 (~2 ulp, GPU only).
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]
# T = 1, an odd T, I not a power of two, and I > 2048 (several programs per row).
SHAPES = [(1, 96), (37, 200), (3, 2100)]


def _inputs(t: int, i: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """x [T, 2I] = [gate | up] as a row-strided view; gate spans the saturating tails of silu."""
    x = torch.randn(t, 2 * i + 16, dtype=dtype, device=device)[:, : 2 * i] * 4
    return x


def _dequant(q: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    return q.float() * scale.repeat_interleave(group, dim=1)[:, : q.shape[1]]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t,i", SHAPES)
def test_silu_and_mul_matches_ref(t: int, i: int, dtype: torch.dtype, device: str) -> None:
    x = _inputs(t, i, dtype, device)
    out = silu_and_mul(x)
    assert out.shape == (t, i) and out.dtype == dtype
    torch.testing.assert_close(out, silu_and_mul_ref(x), atol=TOL[dtype], rtol=TOL[dtype])


def test_ref_matches_hf_mlp_activation() -> None:
    # HF DeepseekV3MLP: act_fn(gate_proj(x)) * up_proj(x) with act_fn = silu; fp32 so rounding cannot differ.
    from transformers.activations import ACT2FN
    x = torch.randn(5, 2 * 200)
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(silu_and_mul_ref(x), ACT2FN["silu"](gate) * up, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("t,i,group", [(1, 96, 128), (37, 200, 128), (3, 2100, 128), (4, 200, 64)])
def test_silu_and_mul_quant_fp8_matches_ref(t: int, i: int, group: int, dtype: torch.dtype, device: str) -> None:
    x = _inputs(t, i, dtype, device)
    x[0, :] = 0                                           # silu(0) * 0: an all-zero row must give zeros
    y_q, scale = silu_and_mul_quant_fp8(x, group)
    ref_q, ref_scale = silu_and_mul_quant_fp8_ref(x, group)
    assert y_q.dtype == torch.float8_e4m3fn and y_q.shape == (t, i)
    assert scale.dtype == torch.float32 and scale.shape == (t, -(-i // group))
    torch.testing.assert_close(scale, ref_scale, atol=0, rtol=TOL[dtype])
    deq, ref_deq = _dequant(y_q, scale, group), _dequant(ref_q, ref_scale, group)
    assert torch.isfinite(deq).all() and (deq[0] == 0).all()
    # At most one e4m3 step apart (2^-3 relative; subnormal step 2^-9 * scale).
    step = ref_deq.abs() * 2**-3 + 2**-9 * ref_scale.repeat_interleave(group, dim=1)[:, :i]
    assert ((deq - ref_deq).abs() <= step * 1.01).all()
    # Within fp8 rounding (2^-4 relative, + margin) of the unquantised activation.
    y = silu_and_mul_ref(x).float()
    assert ((deq - y).abs() <= y.abs() * 0.07 + 2**-9 * scale.max()).all()


def test_launcher_rejects_bad_inputs() -> None:
    with pytest.raises(AssertionError, match=r"\[T, 2I\]"):
        silu_and_mul(torch.randn(4, 7))
    with pytest.raises(AssertionError, match="contiguous"):
        silu_and_mul(torch.randn(8, 4).t())
    with pytest.raises(AssertionError, match="power of two"):
        silu_and_mul_quant_fp8(torch.randn(2, 200), group=100)


def test_bench_byte_counts() -> None:
    # V3 expert: 4096 tokens x I 2048 bf16: read 2 * I, write I.
    assert small_ops.silu_bytes(4096, 2048) == 4096 * 3 * 2048 * 2
    assert small_ops.silu_bytes(1, 200, quant=True) == 800 + 200 + 2 * 4
    assert small_ops.silu_flops(2, 10) == 100


@pytest.mark.parametrize("m_major,pad", [(False, 0), (True, 3)])
def test_silu_and_mul_quant_fp8_is_the_quant_pass_of_the_activation(m_major: bool, pad: int, device: str) -> None:
    # The codes and scales per_token_group_quant_fp8 gives silu_and_mul's output, in its layout (M-major scales over
    # rows padded with quantised zeros, for cuBLAS): what an FP8 down_proj reads.
    from mlaserve.kernels.quant import per_token_group_quant_fp8
    seed = torch.seed()
    print(f"seed {seed}")
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    t, i = 21, 512
    x = _inputs(t, i, dtype, device)
    rows = t + pad
    ref_q, ref_s = per_token_group_quant_fp8(silu_and_mul(x), 128, scale_m_major=m_major, out_rows=rows)
    y_q, scale = silu_and_mul_quant_fp8(x, 128, scale_m_major=m_major, out_rows=rows)
    assert y_q.shape == (rows, i) and scale.stride() == ref_s.stride()
    assert torch.equal(y_q.view(torch.uint8), ref_q.view(torch.uint8))
    assert torch.equal(scale, ref_s)
