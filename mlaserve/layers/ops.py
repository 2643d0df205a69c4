"""The kernel switch: the set of per-op functions a model runs with, chosen once when the model is built.

`get_ops("triton")` holds the Triton launchers (GPU; the CPU under TRITON_INTERPRET=1), `get_ops("torch")` their
PyTorch references from the same `kernels/<op>.py` modules (any device: the spec and the accuracy-debugging
path). Layers call `self.ops.<op>(...)`; no layer looks at the device to choose.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import torch

from mlaserve.core import compile_opaque
from mlaserve.kernels import activation, fp8_gemm, fused_moe, gemv, mla_absorb, moe_topk, norm, quant, rope
from mlaserve.kernels.fp8_gemm import QuantPlan

KERNEL_BACKENDS = ("triton", "torch")


class Ops(NamedTuple):
    name: str                      # "triton" or "torch"
    rmsnorm: Callable              # (x, weight, eps) -> y
    fused_add_rmsnorm: Callable    # (x, residual, weight, eps) -> (y, x + residual)
    silu_and_mul: Callable         # gate_up [T, 2I] -> [T, I]
    moe_topk: Callable             # router logits [T, E] -> (weights [T, K (+ n_shared)], ids [T, K (+ n_shared)])
    moe_route: Callable            # (x [T, h], gate weight [E, h], K) -> moe_topk of the fp32 logits, one launch
    fused_moe: Callable            # (x, w13, w2, weights, ids, w13_scale=, w2_scale=, sync=) -> [T, h]
    fused_moe_norm: Callable       # fused_moe, then (rmsnorm(out + residual), out + residual) for the next layer
    fp8_linear: Callable           # (x, w_q, w_scale_inv) -> y
    mla_rope_kv_store: Callable    # rotate q_pe / k_pe in place and write [kv_c, k_pe] cache rows
    head_gemm: Callable            # (a [T, H, K], w [H, K, N] or [H, N, K] with trans=True) -> [T, H, N]
    rope_head_gemm: Callable       # (q_nope, w_kc, *mla_rope_kv_store's arguments) -> head_gemm(q_nope, w_kc), one launch
    linear: Callable               # (x [T, K], w [N, K], bias) -> [T, N] (16-bit weights)
    moe_route_norm: Callable       # (x, residual, norm weight, eps, gate weight, K) -> moe_route of the norm, + h, x + res
    fp8_quant_plan: Callable       # (m, x, w_q) -> the QuantPlan of fp8_linear's own quantisation pass, or None
    fp8_linear_quantized: Callable  # (x_q, x_scale, m, plan, w_q, w_scale_inv, bias, out_dtype) -> y [m, N]
    rmsnorm_quant: Callable        # (x, weight, eps, residual | None, plan) -> (x_q, scale) of the norm, as plan says
    silu_and_mul_quant: Callable   # (gate_up, plan) -> (y_q, scale) of silu_and_mul, as plan says


def _rmsnorm_quant(x, weight, eps, residual, plan: QuantPlan):
    return norm.rmsnorm_quant_fp8(x, weight, eps, 128, residual, plan.scale_m_major, plan.rows)


def _silu_and_mul_quant(x, plan: QuantPlan):
    return activation.silu_and_mul_quant_fp8(x, 128, plan.scale_m_major, plan.rows)


def _layout_ref(y, plan: QuantPlan):
    # per_token_group_quant_fp8_ref of y [T, K], in plan's rows (padding: quantised zeros) and scale layout
    y = torch.nn.functional.pad(y, (0, 0, 0, plan.rows - y.shape[0]))
    q, s = quant.per_token_group_quant_fp8_ref(y, 128)
    return q, (s.t().contiguous().t() if plan.scale_m_major else s)


def _rmsnorm_quant_ref(x, weight, eps, residual, plan: QuantPlan):
    if residual is None:
        return _layout_ref(norm.rmsnorm_ref(x, weight, eps), plan)
    y, res = norm.fused_add_rmsnorm_ref(x, residual, weight, eps)
    residual.copy_(res)                                  # in place, as the kernel
    return _layout_ref(y, plan)


def _fp8_linear_quantized_ref(x_q, x_scale, m, plan, w_q, w_scale_inv, bias, out_dtype):
    y = fp8_gemm.fp8_gemm_ref(x_q[:m], x_scale[:m], w_q, w_scale_inv, out_dtype=torch.float32)
    return (y if bias is None else y + bias.float()).to(out_dtype)


@functools.lru_cache(maxsize=None)
def get_ops(name: str) -> Ops:
    """The kernel set called `name` (one of KERNEL_BACKENDS)."""
    if name == "triton":
        # NOTE: Triton launchers stay opaque to torch.compile (it compiles the torch code between them)
        return Ops("triton", *map(compile_opaque, (
            norm.rmsnorm, norm.fused_add_rmsnorm, activation.silu_and_mul, moe_topk.moe_topk, moe_topk.moe_route,
            fused_moe.fused_moe, fused_moe.fused_moe_norm, fp8_gemm.fp8_linear, rope.mla_rope_kv_store,
            mla_absorb.head_gemm, mla_absorb.rope_head_gemm, gemv.linear, moe_topk.moe_route_norm,
            fp8_gemm.quant_plan, fp8_gemm.fp8_linear_quantized, _rmsnorm_quant, _silu_and_mul_quant)))
    if name == "torch":
        return Ops("torch", norm.rmsnorm_ref, norm.fused_add_rmsnorm_ref, activation.silu_and_mul_ref,
                   moe_topk.moe_topk_ref, moe_topk.moe_route_ref, fused_moe.fused_moe_ref, fused_moe.fused_moe_norm_ref,
                   fp8_gemm.fp8_linear_ref,
                   rope.mla_rope_kv_store_ref, mla_absorb.head_gemm_ref,
                   mla_absorb.rope_head_gemm_ref, gemv.linear_ref, moe_topk.moe_route_norm_ref,
                   lambda m, x, w_q: None, _fp8_linear_quantized_ref, _rmsnorm_quant_ref,
                   lambda x, plan: _layout_ref(activation.silu_and_mul_ref(x), plan))
    raise ValueError(f"unknown kernel backend {name!r}; choices: {', '.join(KERNEL_BACKENDS)}")
