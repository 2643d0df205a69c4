"""Issue 15 microbenchmark (GPU): each fused decode kernel against the launches it replaces, us per call.

Times are CUDA-graph replays with L2 flushed before each (`time_cuda`), as in a decode step. Parts:
  route  router of one MoE layer: cuBLAS fp32 GEMM + moe_topk + 2 torch.cat (old) vs moe_route (new, one launch)
         vs cuBLAS + moe_topk writing the shared slots (new path above the threshold), T = 1 .. 128; a tile sweep
  sum    fused_moe's combine: torch.sum(y.view(T, k, h), 1) vs sum_dim1; fp8_gemm's split-K sum likewise
  moe    one MoE layer at decode (router + fused_moe with the shared slots): old vs new with the combine as
         sum_dim1 vs new with the combine inside the second GEMM (fused_moe `sync`), T = 1 .. 32
  fp8    fp8_linear at the V3 (N, K) shapes: per_token_group_quant_fp8 + fp8_gemm vs the in-GEMM quantisation
         (tuned tables), and whether the two outputs are bit-identical
Usage: PYTHONPATH=$PWD python3 benchmarks/moe_fuse.py [route] [sum] [moe] [fp8]
"""
from __future__ import annotations

import sys
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from mlaserve.bench.kernel_cases.fp8_gemm import V3_SHAPES
from mlaserve.bench.kernel_cases.fused_moe import MODELS, make_weights
from mlaserve.bench.timing import time_cuda
from mlaserve.kernels import fp8_gemm as fp8_mod
from mlaserve.kernels import fused_moe as fm
from mlaserve.kernels.moe_topk import moe_route, moe_topk, route_config
from mlaserve.kernels.quant import block_quant_fp8_ref
from mlaserve.kernels.reduce import sum_dim1

# (name, E, h, top_k, n_shared, routing kwargs)
ROUTERS = [
    ("v2-lite", 64, 2048, 6, 2, dict(topk_method="greedy", scoring_func="softmax")),
    ("v3", 256, 7168, 8, 1, dict(topk_method="noaux_tc", scoring_func="sigmoid", n_group=8, topk_group=4,
                                 norm_topk_prob=True, routed_scaling_factor=2.5)),
]
ROUTE_TOKENS = (1, 2, 4, 8, 16, 24, 32, 64, 128)
SUM_TOKENS = (1, 4, 16, 64, 256)
MOE_TOKENS = (1, 4, 16, 32)
FP8_M = (1, 16, 64, 128)
DEV = "cuda"


def last_win(sizes: tuple[int, ...], wins: list[bool]) -> int:
    """The largest size up to which the new kernel won at every measured size (0: it lost at the first)."""
    best = 0
    for size, win in zip(sizes, wins):
        if not win:
            break
        best = size
    return best


def us(fn) -> float:
    return 1e3 * time_cuda(fn, warmup=3, iters=30)


def _router_inputs(e: int, h: int, kw: dict):
    w = (torch.randn(e, h, device=DEV) * h ** -0.5).to(torch.bfloat16)
    bias = torch.randn(e, device=DEV) * 0.01 if kw["topk_method"] == "noaux_tc" else None
    return w, w.float(), dict(kw, e_score_correction_bias=bias)


def old_route(x, w32, k, ns, kw, shared_ids, shared_w):
    weights, ids = moe_topk(F.linear(x.float(), w32), k, **kw)
    t = x.shape[0]
    return (torch.cat([weights, shared_w.expand(t, -1)], dim=1),
            torch.cat([ids.to(torch.int32), shared_ids.expand(t, -1)], dim=1))


def same_sets(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.long().sort(1).values, b.long().sort(1).values)


def part_route() -> None:
    print("\n== route: us per call (old: cuBLAS fp32 GEMM + moe_topk + 2 cat | new: moe_route | cublas+topk(shared))")
    for name, e, h, k, ns, kw in ROUTERS:
        w, w32, kw = _router_inputs(e, h, kw)
        shared_ids = torch.arange(e, e + ns, dtype=torch.int32, device=DEV)[None]
        shared_w = torch.ones(1, ns, device=DEV)
        sync = torch.zeros(256, dtype=torch.int32, device=DEV)
        print(f"{name}: E={e} h={h} k={k} n_shared={ns} tiles {route_config(e, h)}")
        wins = []
        for t in ROUTE_TOKENS:
            x = torch.randn(t, h, device=DEV, dtype=torch.bfloat16)
            old = us(lambda: old_route(x, w32, k, ns, kw, shared_ids, shared_w))
            new = us(lambda: moe_route(x, w, k, n_shared=ns, sync=sync, **kw))
            big = us(lambda: moe_topk(F.linear(x.float(), w32), k, n_shared=ns, **kw))
            ok = same_sets(moe_route(x, w, k, n_shared=ns, sync=sync, **kw)[1],
                           old_route(x, w32, k, ns, kw, shared_ids, shared_w)[1])
            print(f"  T={t:4d}  old {old:6.2f}  moe_route {new:6.2f}  cublas+topk {big:6.2f}  same experts {ok}")
            wins.append(new < big)
        print(f"  -> moe_route beats cublas+topk up to T={last_win(ROUTE_TOKENS, wins)} (ROUTE_FUSED_MAX_TOKENS)")
        x = torch.randn(1, h, device=DEV, dtype=torch.bfloat16)
        sweep = []
        for be in (1, 2, 4, 8):
            for nw in (4, 8):
                cfg = dict(route_config(e, h), BLOCK_E=be, num_warps=nw)
                sweep.append((us(lambda: moe_route(x, w, k, n_shared=ns, sync=sync, config=cfg, **kw)), cfg))
        print("  T=1 tile sweep, best 5:", "; ".join(f"{t:.2f} {c}" for t, c in sorted(sweep, key=lambda r: r[0])[:5]))


def part_sum() -> None:
    print("\n== sum: fused_moe combine [T, k, h] -> [T, h] bf16, us per call (torch.sum | sum_dim1)")
    for k, h in ((8, 2048), (9, 7168)):
        for t in SUM_TOKENS:
            y = torch.randn(t, k, h, device=DEV, dtype=torch.bfloat16)
            out = torch.empty(t, h, device=DEV, dtype=torch.bfloat16)
            a = us(lambda: torch.sum(y, dim=1, out=out))
            b = us(lambda: sum_dim1(y, out=out))
            err = (sum_dim1(y).float() - y.float().sum(1)).abs().max().item()
            print(f"  k={k} h={h} T={t:4d}  torch.sum {a:6.2f}  sum_dim1 {b:6.2f}  max|d| vs fp32 {err:.1e}")
    print("  fp8_gemm split-K sum [S, M, N] fp32 -> [M, N] bf16 (out.copy_(c.sum(0)) | sum_dim1)")
    for split, m, n in ((8, 1, 2112), (4, 1, 7168), (8, 16, 4096)):
        c = torch.randn(split, m, n, device=DEV)
        out = torch.empty(m, n, device=DEV, dtype=torch.bfloat16)
        a = us(lambda: out.copy_(c.sum(dim=0)))
        b = us(lambda: sum_dim1(c.view(1, split, m * n), out=out.view(1, m * n)))
        print(f"  S={split} M={m} N={n}  torch {a:6.2f}  sum_dim1 {b:6.2f}")


@contextmanager
def torch_sum_combine():
    """fused_moe with the combine it had before sum_dim1 (torch.sum)."""
    real = fm.sum_dim1
    fm.sum_dim1 = lambda y, out: torch.sum(y, dim=1, out=out)
    try:
        yield
    finally:
        fm.sum_dim1 = real


def part_moe() -> None:
    print("\n== moe: one MoE layer at decode (router + fused_moe, shared slots fused), us per call "
          "(old | new, sum_dim1 | new, in-GEMM combine)")
    for s, (name, e, h, k, ns, kw) in zip(MODELS, ROUTERS):
        if s.fp8:       # V3 at its TP-8 rank width (the full stack is 11 GB)
            s = s._replace(moe_intermediate_size=256)
        s = s._replace(num_experts=s.num_experts + ns)
        wts = make_weights(s, DEV)
        w, w32, kw = _router_inputs(e, h, kw)
        shared_ids = torch.arange(e, e + ns, dtype=torch.int32, device=DEV)[None]
        shared_w = torch.ones(1, ns, device=DEV)
        sync = torch.zeros(256, dtype=torch.int32, device=DEV)
        combine_sync = torch.zeros(1024, dtype=torch.int32, device=DEV)
        fm.COMBINE_MAX_TOKENS = max(MOE_TOKENS)                    # measure the in-GEMM combine at every T
        wins = []
        for t in MOE_TOKENS:
            x = torch.randn(t, h, device=DEV, dtype=torch.bfloat16)

            def old():
                tw, ti = old_route(x, w32, k, ns, kw, shared_ids, shared_w)
                return fm.fused_moe(x, **wts, topk_weights=tw, topk_ids=ti, num_routed_experts=e)

            def new(combine_in_gemm: bool):
                tw, ti = moe_route(x, w, k, n_shared=ns, sync=sync, **kw)
                return fm.fused_moe(x, **wts, topk_weights=tw, topk_ids=ti, num_routed_experts=e,
                                    sync=combine_sync if combine_in_gemm else None)

            with torch_sum_combine():
                a = us(old)
                ref = old()
            b, c = us(lambda: new(False)), us(lambda: new(True))
            err = max(((new(f).float() - ref.float()).abs().max() / ref.float().abs().max()).item() for f in (0, 1))
            print(f"  {name} I={s.moe_intermediate_size} T={t:3d}  old {a:7.2f}  new {b:7.2f}  in-GEMM {c:7.2f}"
                  f"  rel diff {err:.1e}  zero counts {not combine_sync.any()}")
            wins.append(c < b)
        print(f"  -> in-GEMM combine beats sum_dim1 up to T={last_win(MOE_TOKENS, wins)} (COMBINE_MAX_TOKENS)")
        del wts
        torch.cuda.empty_cache()


def part_fp8() -> None:
    print("\n== fp8: fp8_linear us per call (quant + gemm | in-GEMM quant), bit-identical outputs")
    for n, kk in V3_SHAPES:
        w_q, w_s = block_quant_fp8_ref(torch.randn(n, kk, device=DEV) * kk ** -0.5)
        row, wins = [], []
        for m in FP8_M:
            x = torch.randn(m, kk, device=DEV, dtype=torch.bfloat16)
            a = us(lambda: fp8_mod.fp8_linear(x, w_q, w_s, fuse_quant=False, gemv=False))
            b = us(lambda: fp8_mod.fp8_linear(x, w_q, w_s, fuse_quant=True, gemv=False))
            same = torch.equal(fp8_mod.fp8_linear(x, w_q, w_s, fuse_quant=False, gemv=False),
                               fp8_mod.fp8_linear(x, w_q, w_s, fuse_quant=True, gemv=False))
            row.append(f"M={m}: {a:.1f} | {b:.1f}{'' if same else ' NOT-IDENTICAL'}")
            wins.append(b <= a)
        print(f"  N={n} K={kk}  " + "  ".join(row) + f"  -> fused up to M={last_win(FP8_M, wins)}")


PARTS = dict(route=part_route, sum=part_sum, moe=part_moe, fp8=part_fp8)

if __name__ == "__main__":
    from mlaserve.layers.moe import ROUTE_FUSED_MAX_TOKENS
    print(torch.cuda.get_device_name(), "| thresholds now: ROUTE_FUSED_MAX_TOKENS", ROUTE_FUSED_MAX_TOKENS,
          "COMBINE_MAX_TOKENS", fm.COMBINE_MAX_TOKENS, "FUSE_QUANT_MAX_M", fp8_mod.FUSE_QUANT_MAX_M)
    for part in sys.argv[1:] or PARTS:
        PARTS[part]()
