"""Per-kernel GPU time of one `fused_moe` call (torch.profiler), at the shapes far from their floor (GPU).

Usage: PYTHONPATH=$PWD python3 benchmarks/profile_moe.py
"""
from __future__ import annotations

import torch
from torch.profiler import ProfilerActivity, profile

from mlaserve.bench.kernel_cases.fused_moe import MODELS, make_weights, route
from mlaserve.kernels.fused_moe import fused_moe

CASES = {"deepseek-v2-lite": (1, 4096), "deepseek-v3": (1, 64, 4096)}


def main() -> None:
    for s in MODELS:
        w = make_weights(s)
        for tokens in CASES[s.name]:
            x = torch.randn(tokens, s.hidden_size, device="cuda", dtype=torch.bfloat16)
            topk_weights, topk_ids = route(s, tokens)
            run = lambda: fused_moe(x, **w, topk_weights=topk_weights, topk_ids=topk_ids)  # noqa: E731
            for _ in range(3):
                run()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    run()
                torch.cuda.synchronize()
            print(f"\n{s.name} T={tokens} distinct experts {topk_ids.unique().numel()}")
            for ev in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:8]:
                print(f"  {ev.device_time_total / 5:9.1f} us/call  x{ev.count // 5}  {ev.key[:90]}")
        del w
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
