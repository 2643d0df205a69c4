"""Prefill wall time with the shared experts as dense GEMMs (FUSE_SHARED_MAX_TOKENS = 256, the default) or inside
the fused-MoE call at every size (fewer launches: the prefill is host-bound). One runner, V2-Lite full width,
dummy weights, batch 1; the two settings alternate, median of 7 runs each: the wall time of a synchronised prefill,
and its GPU time alone (events around it, queued behind a 150 ms GPU sleep so the host is ahead of the GPU).

    PYTHONPATH=$PWD python benchmarks/probe_prefill_shared.py [--len 1024 4096]
"""
import argparse
import statistics

import torch

import mlaserve.layers.moe as moe
from mlaserve.bench.one_batch import build_parser, build_runner, model_dir
from mlaserve.bench.timing import wall_and_gpu_s
from mlaserve.core import Batch, ForwardMode, Req, SamplingParams

ap = argparse.ArgumentParser()
ap.add_argument("--model-config", default="mlaserve/tools/configs/deepseek-v2-lite.json")
ap.add_argument("--len", type=int, nargs="+", default=[1024, 4096])
cli = ap.parse_args()
args = build_parser().parse_args(["--load-format", "dummy", "--model-config", cli.model_config, "--batch-size", "1",
                                  "--input-len", str(max(cli.len)), "--output-len", "8", "--disable-cuda-graph"])
runner, pool, alloc = build_runner(args, model_dir(args))
default = moe.FUSE_SHARED_MAX_TOKENS
for n in cli.len:
    req = Req("p", torch.randint(2, runner.cfg.vocab_size, (n,)).tolist(),
              SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True), seed=0)
    slots = alloc.alloc(n)
    req.req_pool_idx = pool.alloc()
    pool.write(req.req_pool_idx, 0, slots)
    batch = Batch(ForwardMode.EXTEND, [req], list(req.input_ids), slots, [0], [n], [True])
    times = {default: [], 1 << 30: []}
    for rnd in range(8):
        for limit in times:
            moe.FUSE_SHARED_MAX_TOKENS = limit
            wall_gpu = wall_and_gpu_s(lambda: runner.forward(batch), 300_000_000)
            if rnd:                                   # the first round compiles and warms each setting
                times[limit].append(wall_gpu)
    for limit, ts in times.items():
        wall = statistics.median(t for t, _ in ts) * 1e3
        gpu = statistics.median(g for _, g in ts) * 1e3
        name = "dense GEMMs (default)" if limit == default else "inside fused MoE"
        print(f"prefill 1 x {n}, shared experts {name}: wall {wall:.2f} ms, GPU alone {gpu:.2f} ms")
    alloc.free(slots)
    pool.free(req.req_pool_idx)
moe.FUSE_SHARED_MAX_TOKENS = default
