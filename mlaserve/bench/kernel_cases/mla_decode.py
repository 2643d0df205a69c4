"""`mlaserve bench kernels` rows for mla_decode: V2-Lite (H=16, bandwidth-bound) and V3 (H=128, compute-bound).

Bytes = cache rows read + q + out (the split-KV partials are not counted); FLOPs = 2 * T * H * N * (D + L).
"""
from __future__ import annotations

import math
from typing import Iterator

import torch

from mlaserve.bench.timing import Ceilings, time_cuda
from mlaserve.kernels.mla_decode import (choose_num_kv_splits, decode_programs, mla_decode, mla_decode_ref,
                                         pick_config)

KV_LORA_RANK = 512
ROPE_DIM = 64
HEAD_DIM = KV_LORA_RANK + ROPE_DIM
SM_SCALE = 1.0 / math.sqrt(128 + 64)         # qk_nope_head_dim + qk_rope_head_dim
BF16_TOL = 2e-2                              # max error relative to max |ref|: P and the output are bf16
V3_TFLOPS_TARGET = 300.0 / 771.0             # >= 300 TFLOP/s of the H100's measured 771

# (heads, batch, ctx, bound, target fraction)
SHAPES: list[tuple[int, int, int, str, float | None]] = [
    (16, 1, 4096, "bw", None), (16, 1, 16384, "bw", 0.6),
    (16, 32, 4096, "bw", 0.8), (16, 32, 16384, "bw", 0.8),
    (16, 128, 4096, "bw", 0.8), (16, 128, 16384, "bw", 0.8),
    (128, 1, 4096, "bf16", V3_TFLOPS_TARGET), (128, 32, 4096, "bf16", V3_TFLOPS_TARGET),
    (128, 64, 4096, "bf16", V3_TFLOPS_TARGET),
]
QUICK = {(16, 1, 16384), (16, 32, 4096), (128, 32, 4096)}


def decode_bytes(batch: int, heads: int, ctx: int, kv_bytes: int = 2, q_bytes: int = 2, num_q: int = 1) -> int:
    """Minimal HBM traffic of one decode step: every cache row once, q in, out back."""
    t = batch * num_q
    return batch * ctx * HEAD_DIM * kv_bytes + t * heads * (HEAD_DIM + KV_LORA_RANK) * q_bytes


def decode_flops(batch: int, heads: int, ctx: int, num_q: int = 1) -> int:
    """q . K^T over D plus P @ V over L, per query row per cached token (the causal tail is ignored)."""
    return 2 * batch * num_q * heads * ctx * (HEAD_DIM + KV_LORA_RANK)


def make_inputs(heads: int, batch: int, ctx: int, device: str = "cuda") -> dict:
    """A bf16 pool with every request's tokens in scattered slots (worst case for locality)."""
    slots = torch.randperm(batch * ctx, device=device, dtype=torch.int64).to(torch.int32)
    return dict(q=torch.randn(batch, heads, HEAD_DIM, device=device, dtype=torch.bfloat16),
                kv_cache=torch.randn(batch * ctx, HEAD_DIM, device=device, dtype=torch.bfloat16),
                req_to_token=slots.view(batch, ctx),
                req_pool_idx=torch.arange(batch, device=device, dtype=torch.int32),
                seq_lens=torch.full((batch,), ctx, device=device, dtype=torch.int32),
                sm_scale=SM_SCALE, kv_lora_rank=KV_LORA_RANK)


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6)).item()


def one_case(ceil: Ceilings, heads: int, batch: int, ctx: int, bound: str, target: float | None) -> dict:
    args = make_inputs(heads, batch, ctx)
    cfg = pick_config(heads)
    splits = choose_num_kv_splits(decode_programs(batch, heads), ctx)
    out = torch.empty(batch, heads, KV_LORA_RANK, device="cuda", dtype=torch.bfloat16)
    ms = time_cuda(lambda: mla_decode(**args, num_kv_splits=splits, out=out))
    err = rel_error(mla_decode(**args, num_kv_splits=splits), mla_decode_ref(**args))
    bps = decode_bytes(batch, heads, ctx) / (ms * 1e-3)
    flops = decode_flops(batch, heads, ctx) / (ms * 1e-3)
    frac = bps / ceil["copy_bps"] if bound == "bw" else flops / ceil["bf16_flops"]
    return dict(kernel="mla_decode", shape=f"H={heads} B={batch} ctx={ctx} bf16 S={splits} "
                f"BH={cfg.block_h} BN={cfg.block_n} w={cfg.num_warps} st={cfg.num_stages}",
                ms=ms, tbps=bps / 1e12, tflops=flops / 1e12, bound=bound, frac=frac, target=target,
                err=err, ok=err <= BF16_TOL)


def cases(ceil: Ceilings, quick: bool) -> Iterator[dict]:
    for heads, batch, ctx, bound, target in SHAPES:
        if quick and (heads, batch, ctx) not in QUICK:
            continue
        yield one_case(ceil, heads, batch, ctx, bound, target)
        torch.cuda.empty_cache()
