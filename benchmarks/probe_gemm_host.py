"""Host time of one bf16 torch.nn.functional.linear call on the GPU when the token count M repeats and when every
call brings a new M (eager prefill: a new prompt length each step), for V2-Lite's projection shapes. The GPU is
kept busy by a long kernel first so that the host time is not hidden behind the device.

    PYTHONPATH=$PWD python benchmarks/probe_gemm_host.py
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

SHAPES = {"qkv_a 2048->3648": (3648, 2048), "o_proj 2048->2048": (2048, 2048), "kv_b 512->4096": (4096, 512),
          "shared gate_up 2048->5632": (5632, 2048)}


def host_us(w: torch.Tensor, ms: list[int]) -> float:
    xs = [torch.randn(m, w.shape[1], device="cuda", dtype=torch.bfloat16) for m in ms]
    big = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    for _ in range(20):
        big @ big                                             # the device stays busy while the host launches
    t = time.perf_counter()
    for x in xs:
        F.linear(x, w)
    dt = time.perf_counter() - t
    torch.cuda.synchronize()
    return dt / len(xs) * 1e6


def main() -> None:
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        host_us(w, [512] * 4)                                 # first use of the shape
        same = host_us(w, [512] * 64)
        new = host_us(w, list(range(600, 600 + 64 * 7, 7)))   # 64 M values never seen before
        seen = host_us(w, list(range(600, 600 + 64 * 7, 7)))  # the same 64 again
        print(f"{name:>28}: same M {same:6.1f} us, new M each call {new:6.1f} us, those M again {seen:6.1f} us")


if __name__ == "__main__":
    main()
