"""The fused MoE's two grouped GEMMs at prefill sizes, timed apart, per tile (GPU).

DeepSeek-V3's routed experts (block FP8, E=256, top-8, K=7168, I=2048) and V2-Lite's (bf16, E=64, top-6): for each
token count, the first GEMM (gate + up, silu) and the second (down, weighted) in a CUDA graph, L2 flushed, beside the
rate the same run measures (torch._scaled_mm / torch.matmul at 8192^3), with the tuned config and a list of tiles;
with `--baseline FILE` (a copy of an older fused_moe.py) the tuned config on that kernel too. Every row's
output is checked against the first row's (max |diff| / max |ref|). The FP8 rows include the activation's
quantisation launch, as the call runs it.
A line `PICK tokens config table-file` gives the fastest pair of tiles as a table entry (benchmarks/ab_moe_table.py
times it in the model beside the shipped tables).

Usage: PYTHONPATH=$PWD python3 benchmarks/sweep_moe_prefill.py [--tokens 4096 8192] [--baseline FILE]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys

import torch

from mlaserve.bench.kernel_cases.fused_moe import MODELS, make_weights, route
from mlaserve.bench.timing import measure_matmul_rate, time_cuda
from mlaserve.kernels import fused_moe as fm

# (BLOCK_SIZE_M, BLOCK_SIZE_N, num_warps, num_stages); BLOCK_SIZE_N of the gated GEMM covers gate + up
TILES = [(64, 128, 4, 3), (64, 128, 4, 4), (64, 256, 4, 3), (64, 256, 8, 3), (64, 256, 8, 4), (128, 128, 8, 3),
         (128, 128, 8, 4), (128, 256, 8, 3), (128, 256, 8, 4)]
DOWN_TILES = [(64, 128, 4, 3), (64, 128, 4, 4), (64, 128, 8, 4), (64, 256, 4, 3), (64, 256, 8, 3), (64, 256, 8, 4),
              (128, 128, 8, 3), (128, 256, 8, 3)]


def load_module(path: str):
    spec = importlib.util.spec_from_file_location("fused_moe_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def gemm_flops(s, tokens: int, gated: bool) -> float:
    n = 2 * s.moe_intermediate_size if gated else s.hidden_size
    k = s.hidden_size if gated else s.moe_intermediate_size
    return 2.0 * tokens * s.top_k * n * k


def case(mod, s, w, x, topk_weights, topk_ids, cfg: dict, gated: bool):
    """A callable running one GEMM of `mod`'s fused MoE with cfg, and its output buffer."""
    t, top_k, i = x.shape[0], s.top_k, s.moe_intermediate_size
    routing = mod._route(topk_ids, cfg["BLOCK_SIZE_M"], s.num_experts, s.fp8)
    if gated:
        c = torch.empty(t * top_k, i, dtype=x.dtype, device=x.device)
        src, wt, sc = x, w["w13"], w.get("w13_scale")
        args = (None, cfg, False, (128, 128), top_k, True)
    else:
        gen = torch.Generator(device=x.device).manual_seed(0)           # the same h for every row
        src = torch.randn(t * top_k, i, device=x.device, generator=gen).to(x.dtype)
        c = torch.empty(t * top_k, s.hidden_size, dtype=x.dtype, device=x.device)
        wt, sc = w["w2"], w.get("w2_scale")
        args = (topk_weights.reshape(-1).contiguous(), cfg, False, (128, 128), 1, False)
    run = lambda: mod._grouped_gemm(src, wt, sc, c, routing, *args)  # noqa: E731
    return run, c


def sweep(mod_new, mod_old, s, tokens: int, rate: float, quick: bool) -> None:
    w = make_weights(s)
    torch.manual_seed(1)
    x = torch.randn(tokens, s.hidden_size, device="cuda", dtype=torch.bfloat16)
    topk_weights, topk_ids = route(s, tokens)
    dtype = "fp8_w8a8" if s.fp8 else None
    tuned = fm.get_moe_config(s.num_experts, s.moe_intermediate_size, dtype, tokens)
    print(f"\n## {s.name} T={tokens} ({'fp8' if s.fp8 else 'bf16'} rate {rate / 1e12:.0f} TFLOP/s); tuned {tuned}")
    best: dict[tuple[bool, int], tuple[float, dict]] = {}          # (gated, BM) -> fastest (ms, config)
    for gated in (True, False):
        print(f"\n{'gate+up (gated)' if gated else 'down'} GEMM, {gemm_flops(s, tokens, gated) / 1e12:.3f} TFLOP\n")
        print("| kernel | BM | BN | warps | stages | us | TFLOP/s | of rate | max diff |")
        print("|---|---|---|---|---|---|---|---|---|")
        rows = []
        base_cfg = {k: v for k, v in fm.split_config(tuned)[0 if gated else 1].items() if k != "FUSE_QUANT"}
        if mod_old is not None:
            rows.append(("before (tuned)", mod_old, base_cfg))
        rows.append(("now (tuned)", mod_new, base_cfg))
        for bm, bn, warps, stages in [] if quick else (TILES if gated else DOWN_TILES):
            cfg = dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=128 if s.fp8 else 64, GROUP_SIZE_M=1,
                       num_warps=warps, num_stages=stages)
            rows.append(("now", mod_new, cfg))
        ref = None
        for name, mod, cfg in rows:
            try:
                run, c = case(mod, s, w, x, topk_weights, topk_ids, cfg, gated)
                ms = time_cuda(run, iters=20)
            except Exception as exc:                     # out of resources for this tile: say so, go on
                print(f"| {name} | {cfg['BLOCK_SIZE_M']} | {cfg['BLOCK_SIZE_N']} | {cfg['num_warps']} | "
                      f"{cfg['num_stages']} | failed: {type(exc).__name__} {str(exc).splitlines()[0][:80]} | | | |")
                continue
            out = c.float()
            ref = out if ref is None else ref
            diff = ((out - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
            if mod is mod_new and ms < best.get((gated, cfg["BLOCK_SIZE_M"]), (float("inf"),))[0]:
                best[(gated, cfg["BLOCK_SIZE_M"])] = (ms, cfg)
            tf = gemm_flops(s, tokens, gated) / (ms * 1e-3)
            print(f"| {name} | {cfg['BLOCK_SIZE_M']} | {cfg['BLOCK_SIZE_N']} | {cfg['num_warps']} | "
                  f"{cfg['num_stages']} | {ms * 1e3:.0f} | {tf / 1e12:.0f} | {tf / rate:.1%} | {diff:.1e} |",
                  flush=True)
    # the whole call: the tuned config on both modules, then the fastest pair of tiles sharing a BLOCK_SIZE_M
    pairs = [(best[(True, bm)][0] + best[(False, bm)][0], bm) for bm in {bm for _, bm in best}
             if (True, bm) in best and (False, bm) in best]
    picked = None
    if pairs:
        bm = min(pairs)[1]
        down = {k: best[(False, bm)][1][k] for k in ("BLOCK_SIZE_N", "num_warps", "num_stages")}
        picked = dict(best[(True, bm)][1], down=down)
        table = fm.config_file_name(s.num_experts, s.moe_intermediate_size, dtype)
        print(f"\nPICK {tokens} {json.dumps(picked)} {table}")      # for benchmarks/ab_moe_table.py
    for name, mod, cfg in (("before, tuned", mod_old, None), ("now, tuned", mod_new, None),
                           ("now, fastest tiles", mod_new, picked)):
        if mod is None or (name.endswith("tiles") and cfg is None):
            continue
        out = torch.empty_like(x)
        ms = time_cuda(lambda: mod.fused_moe(x, **w, topk_weights=topk_weights, topk_ids=topk_ids, out=out,
                                             config=cfg), iters=20)
        tf = (gemm_flops(s, tokens, True) + gemm_flops(s, tokens, False)) / (ms * 1e-3)
        print(f"\nfused_moe {name}: {ms * 1e3:.0f} us, {tf / 1e12:.0f} TFLOP/s ({tf / rate:.1%})"
              + (f" {json.dumps(cfg)}" if cfg else ""))
    del w
    torch.cuda.empty_cache()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[4096])
    p.add_argument("--baseline", default=None, help="an older fused_moe.py to time beside this one")
    p.add_argument("--models", nargs="+", default=[m.name for m in MODELS])
    p.add_argument("--quick", action="store_true", help="the tuned tiles only")
    args = p.parse_args(argv)
    old = load_module(args.baseline) if args.baseline else None
    if old is not None:
        old.CONFIG_DIR = fm.CONFIG_DIR                    # its tuned tables: the package's
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    rates = {True: measure_matmul_rate(torch.float8_e4m3fn), False: measure_matmul_rate(torch.bfloat16)}
    for s in MODELS:
        if s.name in args.models:
            for t in args.tokens:
                sweep(fm, old, s, t, rates[s.fp8], args.quick)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
