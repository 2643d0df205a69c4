"""Time `fused_moe` with the shipped tile table's entry and with another table's (a `tune fused-moe` output) at the
same token counts, alternated, on one GPU: the evidence for replacing shipped entries.

Usage: PYTHONPATH=$PWD python3 benchmarks/ab_moe_tables.py --model-config C --dtype fp8_w8a8 --new FILE.json
       [--tokens 1024 4096] [--rounds 3]
Prints, per token count, each table's config and its median us over the rounds, beside the FP8 / bf16 rate this run
measures (`measure_matmul_rate`, 8192^3).
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from mlaserve.bench.kernel_cases.fused_moe import make_weights, route
from mlaserve.bench.timing import measure_matmul_rate
from mlaserve.kernels.fused_moe import fused_moe, get_moe_config
from mlaserve.tools.tune_fused_moe import shape_from_hf_config
from mlaserve.tools.tuning import graph_timer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-config", type=Path, required=True)
    ap.add_argument("--dtype", choices=("fp8_w8a8", "bf16"), default="bf16")
    ap.add_argument("--new", type=Path, required=True, help="a tune fused-moe JSON for the same shape")
    ap.add_argument("--tokens", type=int, nargs="+", default=None, help="default: the new table's keys")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    s = shape_from_hf_config(args.model_config, 1, args.dtype)
    new = {int(k): v for k, v in json.loads(args.new.read_text()).items()}
    weights = make_weights(s)
    rate = measure_matmul_rate(torch.float8_e4m3fn if s.fp8 else torch.bfloat16)
    print(f"{s.name}: E={s.num_experts} I={s.moe_intermediate_size} {args.dtype} on {torch.cuda.get_device_name()}, "
          f"rate {rate / 1e12:.0f} TFLOP/s")
    print("| tokens | table | config | us (median of rounds) | all rounds | of the rate |")
    print("|---|---|---|---|---|---|")
    for t in args.tokens or sorted(new):
        x = torch.randn(t, s.hidden_size, device="cuda", dtype=torch.bfloat16)
        w, ids = route(s, t)
        out = torch.empty_like(x)
        cfgs = {"shipped": get_moe_config(s.num_experts, s.moe_intermediate_size,
                                          args.dtype if s.fp8 else None, t),
                "new": new[min(new, key=lambda m: abs(m - t))]}
        times: dict[str, list[float]] = {k: [] for k in cfgs}
        for _ in range(args.rounds):
            for name, cfg in cfgs.items():
                times[name].append(1e3 * graph_timer(lambda: fused_moe(x, **weights, topk_weights=w, topk_ids=ids,
                                                                       config=cfg, out=out)))
        flop = 2 * t * s.top_k * 3 * s.hidden_size * s.moe_intermediate_size
        for name, cfg in cfgs.items():
            us = statistics.median(times[name])
            print(f"| {t} | {name} | {json.dumps(cfg, separators=(',', ':'))} | {us:.0f} | "
                  f"{' / '.join(f'{v:.0f}' for v in times[name])} | {flop / (us * 1e-6) / rate:.1%} |", flush=True)


if __name__ == "__main__":
    main()
