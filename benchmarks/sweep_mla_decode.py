"""Sweep `mla_decode` tile configs and split counts at the bench shapes (GPU); prints one table per head count.

For each (heads, config) the time at every shape, and the geometric mean of its slowdown against the best
config of each shape; then, for the best config, the time at split counts around `choose_num_kv_splits`.
Usage: PYTHONPATH=$PWD python3 benchmarks/sweep_mla_decode.py [--out FILE]
"""
from __future__ import annotations

import argparse
import itertools
import math

import torch

import mlaserve.kernels.mla_decode as md
from mlaserve.bench.kernel_cases.mla_decode import decode_bytes, decode_flops, make_inputs
from mlaserve.tools.tuning import graph_timer, precompile

SHAPES = {16: [(1, 4096), (1, 16384), (32, 4096), (32, 16384), (128, 4096), (128, 16384)],
          128: [(1, 4096), (32, 4096), (64, 4096)]}


def candidates(heads: int) -> list[md.MLADecodeConfig]:
    if heads == 16:
        space = itertools.product((16,), (32, 64, 128), (4, 8), (2, 3))
    else:
        space = itertools.product((32, 64), (32, 64, 128), (4, 8), (2, 3))
    return [md.MLADecodeConfig(*c) for c in space if not (c[0] == 64 and c[1] == 128)]


def run(heads: int, batch: int, ctx: int, cfg: md.MLADecodeConfig, splits: int | None = None) -> float:
    args = make_inputs(heads, batch, ctx)
    md.CONFIGS = {heads: cfg}
    splits = splits or md.choose_num_kv_splits(md.decode_programs(batch, heads), ctx)
    out = torch.empty(batch, heads, 512, device="cuda", dtype=torch.bfloat16)
    return graph_timer(lambda: md.mla_decode(**args, num_kv_splits=splits, out=out), iters=20)


def _compile_job(job: tuple[int, md.MLADecodeConfig]) -> None:
    heads, cfg = job
    run(heads, 2, 1024, cfg, splits=3)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    lines = [f"mla_decode sweep on {torch.cuda.get_device_name()}"]
    jobs = [(h, c) for h in SHAPES for c in candidates(h)]
    print(f"precompile: {precompile(_compile_job, jobs)} of {len(jobs)} failed", flush=True)
    for heads, shapes in SHAPES.items():
        times: dict[md.MLADecodeConfig, list[float]] = {}
        for cfg in candidates(heads):
            try:
                times[cfg] = [run(heads, b, n, cfg) for b, n in shapes]
            except Exception as exc:  # noqa: BLE001
                print(f"skip {cfg}: {type(exc).__name__}", flush=True)
        best = [min(t[i] for t in times.values()) for i in range(len(shapes))]
        score = {c: math.exp(sum(math.log(t / b) for t, b in zip(ts, best)) / len(ts)) for c, ts in times.items()}
        lines.append(f"\nH={heads} shapes {shapes}; floor-relative: bytes/3.0TB/s, flops/780TF")
        for cfg in sorted(times, key=score.get)[:12]:
            cells = " ".join(f"{t * 1e3:7.1f}" for t in times[cfg])
            lines.append(f"{score[cfg]:.3f} {cfg} us: {cells}")
        top = min(score, key=score.get)
        for (b, n), t in zip(shapes, times[top]):
            md.CONFIGS = {heads: top}
            base = md.choose_num_kv_splits(md.decode_programs(b, heads), n)
            cells = []
            for s in sorted({max(1, base // 4), max(1, base // 2), base, base * 2, base * 4, 1}):
                cells.append(f"S={s}:{run(heads, b, n, top, s) * 1e3:.1f}")
            gbps = decode_bytes(b, heads, n) / (t * 1e-3) / 1e12
            tf = decode_flops(b, heads, n) / (t * 1e-3) / 1e12
            lines.append(f"  B={b} ctx={n} best {t * 1e3:.1f} us {gbps:.2f} TB/s {tf:.0f} TFLOP/s | " + " ".join(cells))
        print("\n".join(lines[-18:]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
