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


_COMPILED_PREQUANT = """
import os
os.environ["TRITON_INTERPRET"] = "1"
import torch
from mlaserve.core import make_compile_opaque
from mlaserve.config import QuantConfig
from mlaserve.kernels.quant import block_quant_fp8_ref
from mlaserve.layers.moe import DenseMLP
from mlaserve.layers.ops import get_ops
from mlaserve.layers.rmsnorm import RMSNorm
make_compile_opaque()
torch.manual_seed(int(os.environ["SEED"]))
ops = get_ops("triton")
quant = QuantConfig(method="fp8", fmt="e4m3", block=(128, 128), activation_scheme="dynamic")
mlp = DenseMLP(256, 512, quant=quant, dtype=torch.float32, device="cpu", ops=ops)
for lin in (mlp.gate_up_proj, mlp.down_proj):
    w, s = block_quant_fp8_ref(torch.randn(lin.weight.shape) * 0.05)
    lin.weight.data.copy_(w)
    lin.weight_scale_inv.data.copy_(s)
norm = RMSNorm(256, 1e-6, torch.float32, "cpu", ops=ops)
plan = ops.fp8_quant_plan
x, res = torch.randn(24, 256), torch.randn(24, 256)
f = lambda x, res: mlp.forward_norm(x, res.clone(), norm)
want = f(x, res)
got = torch.compile(f, backend="eager", dynamic=False)(x, res)
assert plan(24, x, mlp.gate_up_proj.weight) is not None            # 24 rows: the norm and activation quantise ahead
assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
print("ok")
"""


def test_quantise_ahead_path_under_torch_compile() -> None:
    """The dense MLP's norm -> gate_up -> SwiGLU -> down with the norm and activation quantising ahead (24 rows),
    traced by torch.compile (the plan and every launcher opaque, as the runners that compile set them): the eager
    output, bit for bit. A child process: make_compile_opaque is for the whole process."""
    import os
    import subprocess
    import sys

    seed = torch.seed() % 2**31
    print(f"seed {seed}")
    done = subprocess.run([sys.executable, "-c", _COMPILED_PREQUANT], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "SEED": str(seed)})
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
