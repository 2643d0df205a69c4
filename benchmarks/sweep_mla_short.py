"""`mla_decode` at decode-graph conditions, short and long contexts: tile size (BLOCK_N) x split-count policy.

Under a CUDA graph the split count is fixed at capture from the graph's batch size and the server's context
limit (`choose_num_kv_splits(programs, max_context)`), and each request cuts its own length into that many
splits rounded up to BLOCK_N, so at short contexts few programs run, each over a long serial tile.
Usage: PYTHONPATH=$PWD python3 benchmarks/sweep_mla_short.py [--out FILE]
"""
from __future__ import annotations

import argparse

import torch

import mlaserve.kernels.mla_decode as md
from mlaserve.bench.kernel_cases.mla_decode import make_inputs
from mlaserve.tools.tuning import graph_timer

SHAPES = [(1, 256), (1, 1024), (1, 4096), (1, 16384), (16, 256), (16, 2048), (64, 256), (64, 2048)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    args = ap.parse_args()
    lines = [f"mla_decode at graph conditions on {torch.cuda.get_device_name()}; us per call"]
    base = dict(md.CONFIGS)
    for heads in args.heads:
        cur = md.pick_config(heads)
        lines.append(f"\nH={heads}: shapes (batch, ctx) {SHAPES}; current config {cur}")
        for block_n in (16, 32, 64, 128):
            for min_split in (16, 32, 64, 128):
                if min_split < block_n:
                    continue
                md.MIN_SPLIT_TOKENS = min_split
                md.CONFIGS = {k: v._replace(block_n=block_n) for k, v in base.items()}
                cells = []
                for policy in ("ctx", "server"):
                    for b, n in SHAPES:
                        inp = make_inputs(heads, b, n)
                        # "ctx": the graph's limit is this context (the one-batch bench); "server": 163840
                        limit = n + 40 if policy == "ctx" else 163840
                        s = md.choose_num_kv_splits(md.decode_programs(b, heads), limit)
                        out = torch.empty(b, heads, 512, device="cuda", dtype=torch.bfloat16)
                        try:
                            t = graph_timer(lambda: md.mla_decode(**inp, num_kv_splits=s, out=out), iters=20)
                            cells.append(f"{t * 1e3:6.1f}")
                        except Exception as exc:  # noqa: BLE001
                            cells.append(f"{type(exc).__name__[:6]:>6}")
                lines.append(f"block_n {block_n:3d} min_split {min_split:3d} | ctx-limit: {' '.join(cells[:8])} "
                             f"| server-limit: {' '.join(cells[8:])}")
                print(lines[-1], flush=True)
    md.CONFIGS, md.MIN_SPLIT_TOKENS = base, 128
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
