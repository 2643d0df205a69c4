"""Decode-size GEMMs on the GPU: `gemv` vs cuBLAS (F.linear) and `head_gemm` vs torch.einsum, us and TB/s.

Shapes: the bf16 linears of DeepSeek-V2-Lite (merged q + kv_a, o_proj, dense MLP, lm_head) and of V3 (lm_head,
eh_proj), M = 1 .. 16 rows; the absorbed per-head GEMMs (w_kc, w_vc) for H = 16 and 128 at T = 1 .. 256.
Usage: PYTHONPATH=$PWD python3 benchmarks/bench_decode_gemms.py
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from mlaserve.kernels.gemv import gemv
from mlaserve.kernels.mla_absorb import head_gemm
from mlaserve.tools.tuning import graph_timer

LINEARS = {"v2-lite qkv_a": (3648, 2048), "v2-lite o_proj": (2048, 2048), "v2-lite dense gate_up": (21888, 2048),
           "v2-lite dense down": (2048, 10944), "v2-lite lm_head": (102400, 2048), "v3 lm_head": (129280, 7168),
           "v3 eh_proj": (7168, 14336)}


def main() -> None:
    dt = torch.bfloat16
    print(f"decode GEMMs on {torch.cuda.get_device_name()} (bf16, graph replay, L2 flushed)")
    print(f"{'linear':24} {'M':>3} {'cuBLAS us':>10} {'gemv us':>8} {'cuBLAS TB/s':>12} {'gemv TB/s':>10}")
    for name, (n, k) in LINEARS.items():
        w = torch.randn(n, k, device="cuda", dtype=dt) / k ** 0.5
        for m in (1, 4, 8, 16):
            x = torch.randn(m, k, device="cuda", dtype=dt)
            err = (gemv(x, w).float() - F.linear(x, w).float()).abs().max().item()
            assert err < 5e-2, f"{name} M={m}: max error {err}"
            tb = graph_timer(lambda: F.linear(x, w), iters=20)
            tg = graph_timer(lambda: gemv(x, w), iters=20)
            nbytes = n * k * 2
            print(f"{name:24} {m:3d} {tb * 1e3:10.1f} {tg * 1e3:8.1f} {nbytes / tb / 1e9:12.2f} {nbytes / tg / 1e9:10.2f}",
                  flush=True)
    print(f"\n{'head gemm':24} {'T':>3} {'einsum us':>10} {'triton us':>10}")
    for heads in (16, 128):
        w_kc = torch.randn(heads, 128, 512, device="cuda", dtype=dt)
        w_vc = torch.randn(heads, 128, 512, device="cuda", dtype=dt)
        for t in (1, 16, 64, 256):
            q = torch.randn(t, heads, 192, device="cuda", dtype=dt)[..., :128]
            o = torch.randn(t, heads, 512, device="cuda", dtype=dt)
            te = graph_timer(lambda: torch.einsum("thd,hdl->thl", q, w_kc), iters=20)
            tt = graph_timer(lambda: head_gemm(q, w_kc), iters=20)
            print(f"{f'w_kc H={heads}':24} {t:3d} {te * 1e3:10.1f} {tt * 1e3:10.1f}", flush=True)
            te = graph_timer(lambda: torch.einsum("thl,hvl->thv", o, w_vc), iters=20)
            tt = graph_timer(lambda: head_gemm(o, w_vc, trans=True), iters=20)
            print(f"{f'w_vc H={heads}':24} {t:3d} {te * 1e3:10.1f} {tt * 1e3:10.1f}", flush=True)


if __name__ == "__main__":
    main()
