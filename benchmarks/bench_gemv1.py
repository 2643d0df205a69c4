"""One-row linears and the greedy argmax on the GPU: `gemv1` against cuBLAS and `gemv`, `argmax_rows` against torch.

Each case is one CUDA graph of CHAIN back-to-back calls, each on its own weight (together past the L2), so a call
starts while the one before it ends, as in the decode graph (PDL lets gemv1 read its weights then). Printed: us per
call (median of the replays), and the weight's bytes over that time.
Usage: PYTHONPATH=$PWD python3 benchmarks/bench_gemv1.py
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from chain_timer import chain_us

from mlaserve.kernels.gemv import gemv, gemv1
from mlaserve.kernels.sampling import argmax_rows

CHAIN = 20
LINEARS = {"v2-lite qkv_a": (3648, 2048), "v2-lite o_proj": (2048, 2048), "v2-lite o_proj tp2": (2048, 1024),
           "v2-lite qkv_a tp2": (2112, 2048), "v2 q_a + kv_a": (2112, 5120)}


def main() -> None:
    dt = torch.bfloat16
    print(f"one-row linears on {torch.cuda.get_device_name()} (bf16, {CHAIN} calls back to back in a graph)")
    print(f"{'linear':20} {'N x K':>12} {'cuBLAS us':>10} {'gemv us':>8} {'gemv1 us':>9} {'gemv1 TB/s':>11} {'err':>8}")
    for name, (n, k) in LINEARS.items():
        ws = [torch.randn(n, k, device="cuda", dtype=dt) / k ** 0.5 for _ in range(CHAIN)]
        x = torch.randn(1, k, device="cuda", dtype=dt)
        want = F.linear(x.float(), ws[0].float())
        err = (gemv1(x, ws[0]).float() - want).abs().max().item() / want.abs().max().item()
        assert err < 1e-2, f"{name}: relative error {err}"
        tb = chain_us([lambda w=w: F.linear(x, w) for w in ws])
        tg = chain_us([lambda w=w: gemv(x, w) for w in ws])
        t1 = chain_us([lambda w=w: gemv1(x, w) for w in ws])
        print(f"{name:20} {f'{n} x {k}':>12} {tb:10.2f} {tg:8.2f} {t1:9.2f} {n * k * 2 / t1 / 1e6:11.2f} {err:8.1e}",
              flush=True)
    print(f"\n{'argmax rows x V':20} {'torch us':>10} {'argmax_rows us':>15}")
    for b, v in ((1, 102400), (16, 102400), (64, 102400), (1, 129280), (64, 129280)):
        xs = [torch.randn(b, v, device="cuda") for _ in range(CHAIN)]
        for x in xs[:3]:
            assert torch.equal(argmax_rows(x), x.argmax(-1))
        tt = chain_us([lambda x=x: x.argmax(-1) for x in xs])
        ta = chain_us([lambda x=x: argmax_rows(x) for x in xs])
        print(f"{f'{b} x {v}':20} {tt:10.2f} {ta:15.2f}", flush=True)


if __name__ == "__main__":
    main()
