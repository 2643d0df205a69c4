"""`mla_decode` (H = 16, V2-Lite) at the one-batch bench's decode shapes: tile (BLOCK_N, warps, stages) x split count.

Each cell is the median us of one call (decode kernel + reduce) replayed from a CUDA graph, L2 flushed. The row
marked `now` is what `pick_config` and `choose_num_kv_splits` pick today.
Usage: PYTHONPATH=$PWD python3 benchmarks/sweep_mla_batch.py [--heads 16] [--out FILE]
"""
from __future__ import annotations

import argparse
import itertools

import torch

import mlaserve.kernels.mla_decode as md
from mlaserve.bench.kernel_cases.mla_decode import make_inputs
from mlaserve.tools.tuning import graph_timer

SHAPES = [(1, 288), (16, 288), (64, 288), (64, 1024), (16, 2048)]
SPLITS = (1, 2, 3, 4, 6, 8)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    base = dict(md.CONFIGS)
    cur = md.pick_config(a.heads)
    lines = [f"mla_decode H={a.heads} on {torch.cuda.get_device_name()}: us per call (graph, L2 flushed); "
             f"current {cur}"]
    inputs = {s: make_inputs(a.heads, *s) for s in SHAPES}
    outs = {s: torch.empty(s[0], a.heads, 512, device="cuda", dtype=torch.bfloat16) for s in SHAPES}
    now = {s: md.choose_num_kv_splits(md.decode_programs(s[0], a.heads), s[1]) for s in SHAPES}
    best: dict = {}
    for block_n, warps, stages in itertools.product((16, 32, 64), (4, 8), (1, 2, 3, 4)):
        md.CONFIGS = {k: v._replace(block_n=block_n, num_warps=warps, num_stages=stages) for k, v in base.items()}
        for shape in SHAPES:
            cells = []
            for splits in SPLITS:
                try:
                    t = graph_timer(lambda: md.mla_decode(**inputs[shape], num_kv_splits=splits, out=outs[shape]),
                                    iters=20) * 1e3
                except Exception as exc:  # noqa: BLE001 (a tile that does not fit is a cell, not the end)
                    cells.append(f"{type(exc).__name__[:6]:>6}")
                    continue
                cells.append(f"{t:6.1f}")
                if t < best.get(shape, (1e9,))[0]:
                    best[shape] = (t, block_n, warps, stages, splits)
            mark = " now" if (block_n, warps, stages) == (cur.block_n, cur.num_warps, cur.num_stages) else ""
            lines.append(f"BN {block_n:2d} w {warps} st {stages} {shape}: splits {SPLITS} -> {' '.join(cells)}"
                         f"{mark} (now splits {now[shape]})")
            print(lines[-1], flush=True)
    md.CONFIGS = base
    lines.append("best per shape (us, BN, warps, stages, splits): " + "; ".join(f"{s}: {b}" for s, b in best.items()))
    print(lines[-1])
    if a.out:
        with open(a.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
