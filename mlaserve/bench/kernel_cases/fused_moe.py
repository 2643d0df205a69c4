"""Benchmark cases for `fused_moe`: DeepSeek-V2-Lite (bf16) and DeepSeek-V3 (block fp8) routed experts.

Small token counts are bound by the bytes of the distinct experts hit; large ones by tensor-core rate.
"""
from __future__ import annotations

from typing import Iterator, NamedTuple

import torch

from mlaserve.bench.timing import Ceilings, time_cuda
from mlaserve.kernels.fused_moe import fused_moe, fused_moe_ref
from mlaserve.kernels.moe_topk import moe_topk

TOKENS = (1, 16, 64, 1024, 4096)
QUICK_TOKENS = (1, 64, 4096)
BW_BOUND_TOKENS = 64            # up to here the target is bandwidth, above it matmul rate
TARGET = {"bw": 0.7, "bf16": 0.5, "fp8": 0.5}
TOL = {"bf16": 2e-2, "fp8": 3e-2}   # max |out - ref| / max |ref| (bf16 output rounding, fp32 sum order)


class MoeShape(NamedTuple):
    name: str
    num_experts: int            # E
    top_k: int
    hidden_size: int            # K
    moe_intermediate_size: int  # I
    fp8: bool
    n_group: int
    topk_group: int
    ep: int = 1                 # expert parallel: E above is one rank's share of E * ep routed experts


MODELS = (
    MoeShape("deepseek-v2-lite", 64, 6, 2048, 1408, False, 1, 1),
    MoeShape("deepseek-v3", 256, 8, 7168, 2048, True, 8, 4),
)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def expert_bytes(s: MoeShape) -> int:
    """Bytes of one expert's w13 + w2 (+ fp8 block scales, float32 per 128x128 block)."""
    k, i = s.hidden_size, s.moe_intermediate_size
    if not s.fp8:
        return 3 * k * i * 2
    scales = cdiv(2 * i, 128) * cdiv(k, 128) + cdiv(k, 128) * cdiv(i, 128)
    return 3 * k * i + 4 * scales


def moe_bytes(s: MoeShape, tokens: int, distinct_experts: int) -> int:
    """Minimal HBM traffic: distinct experts' weights + x read + out written (bf16)."""
    return distinct_experts * expert_bytes(s) + 2 * tokens * s.hidden_size * 2


def moe_flops(s: MoeShape, tokens: int) -> int:
    """2 * tokens * top_k * (gate + up + down) MACs per routed slot."""
    return 2 * tokens * s.top_k * 3 * s.hidden_size * s.moe_intermediate_size


def make_weights(s: MoeShape, device: str = "cuda") -> dict[str, torch.Tensor]:
    """Random expert weights of realistic scale (outputs ~ 1); fp8 built expert by expert to bound memory."""
    e, k, i = s.num_experts, s.hidden_size, s.moe_intermediate_size
    if not s.fp8:
        return dict(w13=torch.randn(e, 2 * i, k, device=device, dtype=torch.bfloat16) * k ** -0.5,
                    w2=torch.randn(e, k, i, device=device, dtype=torch.bfloat16) * i ** -0.5)
    w13 = torch.empty(e, 2 * i, k, device=device, dtype=torch.float8_e4m3fn)
    w2 = torch.empty(e, k, i, device=device, dtype=torch.float8_e4m3fn)
    for j in range(e):
        w13[j] = torch.randn(2 * i, k, device=device, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
        w2[j] = torch.randn(k, i, device=device, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
    u = lambda *shape: torch.rand(*shape, device=device) + 0.5  # noqa: E731
    return dict(w13=w13, w2=w2, w13_scale=u(e, cdiv(2 * i, 128), cdiv(k, 128)) * k ** -0.5,
                w2_scale=u(e, cdiv(k, 128), cdiv(i, 128)) * i ** -0.5)


def route(s: MoeShape, tokens: int, device: str = "cuda") -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k over all E * ep experts; under EP, ids as rank 0 sees them (local, -1 for other ranks' experts)."""
    n = s.num_experts * s.ep
    logits = torch.randn(tokens, n, device=device)
    if s.fp8:
        bias = torch.randn(n, device=device) * 0.01
        weights, ids = moe_topk(logits, s.top_k, topk_method="noaux_tc", scoring_func="sigmoid", n_group=s.n_group,
                                topk_group=s.topk_group, norm_topk_prob=True, routed_scaling_factor=2.5,
                                e_score_correction_bias=bias)
    else:
        weights, ids = moe_topk(logits, s.top_k, topk_method="greedy", scoring_func="softmax")
    return weights, torch.where(ids < s.num_experts, ids, -1).to(torch.int32)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-6)).item()


def _row(s: MoeShape, tokens: int, w: dict[str, torch.Tensor], ceil: Ceilings) -> dict:
    x = torch.randn(tokens, s.hidden_size, device="cuda", dtype=torch.bfloat16)
    topk_weights, topk_ids = route(s, tokens)
    out = torch.empty_like(x)
    ms = time_cuda(lambda: fused_moe(x, **w, topk_weights=topk_weights, topk_ids=topk_ids, out=out))
    err = _rel_err(out, fused_moe_ref(x, **w, topk_weights=topk_weights, topk_ids=topk_ids))
    nbytes = moe_bytes(s, tokens, topk_ids.unique().numel())
    flops = moe_flops(s, tokens)
    bound = "bw" if tokens <= BW_BOUND_TOKENS else ("fp8" if s.fp8 else "bf16")
    rate = nbytes / (ms * 1e-3) if bound == "bw" else flops / (ms * 1e-3)
    ceiling = {"bw": ceil["copy_bps"], "bf16": ceil["bf16_flops"], "fp8": ceil["fp8_flops"]}[bound]
    dtype = "fp8" if s.fp8 else "bf16"
    return dict(kernel="fused_moe", shape=f"{s.name} {dtype} T={tokens} E={s.num_experts} k={s.top_k} "
                f"K={s.hidden_size} I={s.moe_intermediate_size}", ms=ms, tbps=nbytes / (ms * 1e-3) / 1e12,
                tflops=flops / (ms * 1e-3) / 1e12, mma=dtype, bound=bound, frac=rate / ceiling, target=TARGET[bound],
                err=err, ok=err <= TOL[dtype])


def cases(ceil: Ceilings, quick: bool) -> Iterator[dict]:
    for s in MODELS:
        w = make_weights(s)
        for tokens in QUICK_TOKENS if quick else TOKENS:
            yield _row(s, tokens, w, ceil)
        del w
        torch.cuda.empty_cache()
