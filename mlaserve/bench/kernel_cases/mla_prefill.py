"""`mlaserve bench kernels` rows for `mla_prefill` (non-absorbed MLA extend) at DeepSeek shapes, bf16 on CUDA.

FLOPs: QK^T + PV with the causal part counted as E*E/2 pairs (plus E*P prefix pairs), plus kv_b_proj on the prefix.
"""
from __future__ import annotations

from typing import Callable, Iterator

import torch

from mlaserve.bench.timing import Ceilings, time_cuda
from mlaserve.kernels.mla_prefill import mla_prefill, mla_prefill_ref

D_NOPE, D_ROPE, D_V, KV_LORA_RANK = 128, 64, 128, 512
D_QK = D_NOPE + D_ROPE
TOL = 2e-2            # bf16: max abs error / max |ref|
REF_HEADS = 16        # the reference runs on this many heads (heads are independent) to bound its memory

# (shape label, heads, extend_lens, prefix_lens, target fraction of the bf16 ceiling)
SHAPES = [
    ("V2-Lite H16 1x4096", 16, [4096], [0], 0.6),
    ("V2-Lite H16 8x1024 +4096 prefix", 16, [1024] * 8, [4096] * 8, 0.5),
    ("V3 H128 1x4096", 128, [4096], [0], 0.6),
]


def attn_flops(ext: list[int], pre: list[int], heads: int, d_qk: int = D_QK, d_v: int = D_V) -> float:
    """QK^T and PV FLOPs: each request does E*E/2 causal pairs plus E*P prefix pairs per head."""
    return float(sum(2 * (e * e / 2 + e * p) * heads * (d_qk + d_v) for e, p in zip(ext, pre)))


def expand_flops(pre: list[int], heads: int, kv_lora_rank: int = KV_LORA_RANK, d_nope: int = D_NOPE,
                 d_v: int = D_V) -> float:
    """kv_b_proj on every prefix token: [P, L] @ [L, H * (Dn + Dv)]."""
    return float(2 * sum(pre) * kv_lora_rank * heads * (d_nope + d_v))


def min_bytes(ext: list[int], pre: list[int], heads: int, elt: int = 2) -> int:
    """q, k_new, v_new read + out written + prefix latent rows + the kv_b_proj weight, once each."""
    t, p = sum(ext), sum(pre)
    tokens = t * heads * (2 * D_QK + 2 * D_V)
    return elt * (tokens + p * (KV_LORA_RANK + D_ROPE) + heads * (D_NOPE + D_V) * KV_LORA_RANK)


def _expander(w: torch.Tensor, heads: int) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    # w: [H * (Dn + Dv), L] kv_b_proj weight; latent [n, L] -> k_nope [n, H, Dn], v [n, H, Dv]
    def expand_kv(latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kv = (latent @ w.t()).view(latent.shape[0], heads, D_NOPE + D_V)
        return kv[..., :D_NOPE], kv[..., D_NOPE:]
    return expand_kv


def _inputs(heads: int, ext: list[int], pre: list[int]) -> dict:
    dev, dt, t = "cuda", torch.bfloat16, sum(ext)
    ctx = [p + e for p, e in zip(pre, ext)]
    slots = torch.randperm(sum(ctx), device=dev).to(torch.int32)      # scattered slots, as after churn
    req_to_token = torch.zeros(len(ext), max(ctx), dtype=torch.int32, device=dev)
    for b, (start, n) in enumerate(zip([0, *torch.tensor(ctx).cumsum(0).tolist()], ctx)):
        req_to_token[b, :n] = slots[start:start + n]
    return dict(q=torch.randn(t, heads, D_QK, device=dev, dtype=dt),
                k_new=torch.randn(t, heads, D_QK, device=dev, dtype=dt),
                v_new=torch.randn(t, heads, D_V, device=dev, dtype=dt),
                extend_lens=torch.tensor(ext), prefix_lens=torch.tensor(pre),
                kv_cache=torch.randn(sum(ctx), KV_LORA_RANK + D_ROPE, device=dev, dtype=dt),
                req_to_token=req_to_token, req_pool_idx=torch.arange(len(ext)),
                w=torch.randn(heads * (D_NOPE + D_V), KV_LORA_RANK, device=dev, dtype=dt) / KV_LORA_RANK**0.5)


def _error(out: torch.Tensor, x: dict, heads: int, sm_scale: float) -> float:
    hs = min(heads, REF_HEADS)
    w = x["w"].view(heads, D_NOPE + D_V, KV_LORA_RANK)[:hs].reshape(-1, KV_LORA_RANK)
    ref = mla_prefill_ref(x["q"][:, :hs], x["k_new"][:, :hs], x["v_new"][:, :hs], x["extend_lens"],
                          x["prefix_lens"], x["kv_cache"], x["req_to_token"], x["req_pool_idx"],
                          _expander(w, hs), sm_scale).float()
    return ((out[:, :hs].float() - ref).abs().max() / ref.abs().max()).item()


def _case(ceil: Ceilings, label: str, heads: int, ext: list[int], pre: list[int], target: float,
          iters: int) -> dict:
    x, sm_scale = _inputs(heads, ext, pre), D_QK**-0.5
    run = lambda: mla_prefill(x["q"], x["k_new"], x["v_new"], x["extend_lens"], x["prefix_lens"],  # noqa: E731
                              x["kv_cache"], x["req_to_token"], x["req_pool_idx"], _expander(x["w"], heads),
                              sm_scale)
    err = _error(run(), x, heads, sm_scale)
    ms = time_cuda(run, iters=iters, graph=False)     # host-side planning: not capturable
    flops = attn_flops(ext, pre, heads) + expand_flops(pre, heads)
    tflops = flops / (ms * 1e-3) / 1e12
    return dict(kernel="mla_prefill", shape=label, ms=ms, tbps=min_bytes(ext, pre, heads) / (ms * 1e-3) / 1e12,
                tflops=tflops, bound="bf16", frac=tflops * 1e12 / ceil["bf16_flops"], target=target,
                err=err, ok=err <= TOL)


def cases(ceil: Ceilings, quick: bool) -> Iterator[dict]:
    for label, heads, ext, pre, target in SHAPES:
        yield _case(ceil, label, heads, ext, pre, target, iters=10 if quick else 50)
