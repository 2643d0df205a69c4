"""Per-kernel GPU time of one `fused_moe` call (torch.profiler), at the shapes far from their floor (GPU).

Usage: PYTHONPATH=$PWD python3 benchmarks/profile_moe.py
"""
from __future__ import annotations

import torch

from mlaserve.bench.kernel_cases.fused_moe import MODELS, make_weights, route
from mlaserve.bench.timing import kernel_breakdown
from mlaserve.kernels.fused_moe import fused_moe

CASES = {"deepseek-v2-lite": (1, 4096), "deepseek-v3": (1, 64, 4096)}


def main() -> None:
    for s in MODELS:
        w = make_weights(s)
        for tokens in CASES[s.name]:
            x = torch.randn(tokens, s.hidden_size, device="cuda", dtype=torch.bfloat16)
            topk_weights, topk_ids = route(s, tokens)
            run = lambda: fused_moe(x, **w, topk_weights=topk_weights, topk_ids=topk_ids)  # noqa: E731
            print(f"\n{s.name} T={tokens} distinct experts {topk_ids.unique().numel()}")
            print("\n".join("  " + line for line in kernel_breakdown(run)))
        del w
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
