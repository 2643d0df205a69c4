"""The seeded sampler (`gumbel_argmax`) on the GPU, us a call, 20 calls back to back in one CUDA graph.

Run it from two trees to compare kernels (it imports the `mlaserve` on PYTHONPATH), as `gpu_merge_moe.sh sampler` does:
PYTHONPATH=$PWD python3 benchmarks/bench_sampler.py
"""
from __future__ import annotations

import torch

from chain_timer import chain_us

from mlaserve.kernels.sampling import gumbel_argmax, gumbel_argmax_ref

CHAIN = 20


def main() -> None:
    print(f"gumbel_argmax on {torch.cuda.get_device_name()} ({CHAIN} calls back to back in a graph)")
    for b, v in ((1, 102400), (16, 102400), (64, 102400), (1, 129280), (64, 129280)):
        xs = [torch.randn(b, v, device="cuda") for _ in range(CHAIN)]
        seeds = torch.randint(0, 2**62, (b,), device="cuda")
        steps = torch.randint(0, 2**20, (b,), device="cuda")
        assert torch.equal(gumbel_argmax(xs[0], seeds, steps), gumbel_argmax_ref(xs[0], seeds, steps))
        t = chain_us([lambda x=x: gumbel_argmax(x, seeds, steps) for x in xs])
        print(f"{b} x {v}: {t:.2f} us", flush=True)


if __name__ == "__main__":
    main()
