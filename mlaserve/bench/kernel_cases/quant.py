"""Bench cases for `per_token_group_quant_fp8` (activation quantisation before every FP8 linear): bandwidth."""
from __future__ import annotations

from typing import Iterator

import torch

from mlaserve.bench.timing import Ceilings, time_cuda
from mlaserve.kernels.quant import per_token_group_quant_fp8, per_token_group_quant_fp8_ref

SHAPES = [(1, 7168), (4096, 7168), (16384, 7168)]          # (M, K): K = DeepSeek-V3 hidden_size
TARGET = 0.6               # fraction of copy bandwidth for M >= 4096 (M = 1 is launch-latency bound)
TOL = 1 / 16               # e4m3: |deq - deq_ref| <= group amax / 16


def quant_bytes(m: int, k: int, group: int = 128, in_bytes: int = 2) -> int:
    """Minimal traffic: read x, write x_q (1 byte) and the float32 scales."""
    return m * k * in_bytes + m * k + m * (-(-k // group)) * 4


def cases(ceil: Ceilings, quick: bool) -> Iterator[dict]:
    for m, k in SHAPES[1:2] if quick else SHAPES:
        yield _case(ceil, m, k)


def _case(ceil: Ceilings, m: int, k: int) -> dict:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    ms = time_cuda(lambda: per_token_group_quant_fp8(x))
    (x_q, s), (x_qr, s_r) = per_token_group_quant_fp8(x), per_token_group_quant_fp8_ref(x)
    deq = (x_q.float().view(m, -1, 128) * s[..., None]) - (x_qr.float().view(m, -1, 128) * s_r[..., None])
    amax = x.float().view(m, -1, 128).abs().amax(-1, keepdim=True).clamp_min(1e-30)
    err = (deq.abs() / amax).max().item()
    tbps = quant_bytes(m, k) / (ms * 1e-3)
    return dict(kernel="per_token_group_quant_fp8", shape=f"M={m} K={k}", ms=ms, tbps=tbps / 1e12, tflops=0.0,
                bound="bw", frac=tbps / ceil["copy_bps"], target=TARGET if m >= 4096 else None,
                err=err, ok=err <= TOL)
