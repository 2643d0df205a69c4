"""Sweep the flash kernel's (BLOCK_M, BLOCK_N, warps, stages) at the `bench kernels` prefill shapes (GPU), then
profile the prefix case kernel by kernel with the best one.

Usage: PYTHONPATH=$PWD python3 benchmarks/sweep_mla_prefill.py [--out FILE]
"""
from __future__ import annotations

import argparse
import itertools
import math

import torch

import mlaserve.kernels.mla_prefill as mp
from mlaserve.bench.kernel_cases import mla_prefill as case
from mlaserve.bench.timing import Ceilings, kernel_breakdown


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    ceil = Ceilings(copy_bps=3.0e12, bf16_flops=780e12, fp8_flops=1400e12)    # fractions only for ranking
    lines = [f"mla_prefill flash sweep on {torch.cuda.get_device_name()} (TFLOP/s per shape; geo-mean rank)"]
    results = {}
    for cfg in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3)):
        if cfg[0] == 128 and cfg[1] == 128 and cfg[2] == 4:
            continue
        mp.FLASH_CONFIG = cfg
        try:
            rows = [case._case(ceil, label, heads, ext, pre, target, iters=10)
                    for label, heads, ext, pre, target in case.SHAPES]
        except Exception as exc:  # noqa: BLE001
            print(f"skip {cfg}: {type(exc).__name__}", flush=True)
            continue
        results[cfg] = [r["tflops"] for r in rows]
        print(cfg, " ".join(f"{t:.0f}" for t in results[cfg]), flush=True)
    best = [max(r[i] for r in results.values()) for i in range(len(case.SHAPES))]
    score = {c: math.exp(sum(math.log(b / t) for t, b in zip(r, best)) / len(r)) for c, r in results.items()}
    for cfg in sorted(score, key=score.get)[:10]:
        lines.append(f"{score[cfg]:.3f} {cfg} " + " ".join(f"{t:.0f}" for t in results[cfg]))
    mp.FLASH_CONFIG = min(score, key=score.get)
    label, heads, ext, pre, _ = case.SHAPES[1]
    x = case._inputs(heads, ext, pre)
    run = lambda: mp.mla_prefill(x["q"], x["k_new"], x["v_new"], x["extend_lens"], x["prefix_lens"],  # noqa: E731
                                 x["kv_cache"], x["req_to_token"], x["req_pool_idx"], case._expander(x["w"], heads),
                                 case.D_QK**-0.5)
    lines.append(f"\nprofile of {label} with {mp.FLASH_CONFIG}:")
    lines += ["  " + line for line in kernel_breakdown(run, calls=3, top=10)]
    print("\n".join(lines), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
