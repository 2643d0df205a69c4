"""The fused MoE's combine at prefill sizes: torch.sum over [T, k, h] bf16 against `sum_dim1(rows=True)` at several
row-blocked tiles (GPU; CUDA-graph replays, L2 flushed), beside the copy bandwidth's floor for the bytes moved.

Usage: PYTHONPATH=$PWD python3 benchmarks/bench_combine.py [--tokens 64 256 1024 4096 8192]
"""
from __future__ import annotations

import argparse

import torch

import mlaserve.kernels.reduce as red
from mlaserve.bench.timing import measure_copy_bandwidth, time_cuda

TILES = [(16, 256, 4), (8, 512, 4), (32, 256, 8), (16, 512, 8), (4, 1024, 4), (8, 256, 4), (32, 128, 4)]
SHAPES = [(6, 2048, "V2-Lite prefill (routed)"), (8, 2048, "V2-Lite decode (+shared)"), (8, 7168, "V3 prefill (routed)"),
          (9, 7168, "V3 decode (+shared)")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[64, 256, 1024, 4096, 8192])
    args = ap.parse_args()
    bw = measure_copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}, copy {bw / 1e12:.2f} TB/s; us per call (floor: bytes read + written at "
          f"the copy rate); tiles (BLOCK_A, BLOCK_C, warps)")
    print("| k | h | T | floor | torch.sum | " + " | ".join(str(t) for t in TILES) + " | max bf16 ulps vs torch.sum |")
    print("|---" * (6 + len(TILES)) + "|")
    for k, h, _ in SHAPES:
        for t in args.tokens:
            x = torch.randn(t, k, h, device="cuda", dtype=torch.bfloat16)
            out = torch.empty(t, h, device="cuda", dtype=torch.bfloat16)
            floor = (x.numel() + out.numel()) * 2 / bw * 1e6
            ref = torch.sum(x, dim=1)
            row = [1e3 * time_cuda(lambda: torch.sum(x, dim=1, out=out))]
            worst = 0
            for tile in TILES:
                red.SUM_ROWS_CONFIG = tile
                row.append(1e3 * time_cuda(lambda: red.sum_dim1(x, out=out, rows=True)))
                d = (out.float() - ref.float()).abs() / ref.float().abs().clamp_min(1e-30)
                worst = max(worst, int((d * 256).max().ceil().item()))
            print(f"| {k} | {h} | {t} | {floor:.1f} | " + " | ".join(f"{v:.1f}" for v in row) + f" | {worst} |",
                  flush=True)


if __name__ == "__main__":
    main()
