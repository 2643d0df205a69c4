"""The flash prefill kernel's tiles at one 4,096-token causal prompt of V3's 128 heads and V2-Lite's 16 (GPU).

`mla_prefill._flash_attn` with each (BLOCK_M, BLOCK_N, warps, stages), q / k [T, H, 128 + 64] (the rope key shared by
the heads, as the model passes it), v [T, H, 128], bf16; CUDA events over 10 calls after 2, the median of 3 rounds.
Prints TFLOP/s (the causal pairs' 2 * (192 + 128) FLOPs per head) beside the shipped FLASH_CONFIG's."""
import itertools
import statistics

import torch

import mlaserve.kernels.mla_prefill as mp

T = 4096
CONFIGS = [(128, 64, 8, 3), (128, 64, 8, 2), (128, 64, 8, 4), (128, 32, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3),
           (64, 64, 4, 4), (64, 128, 4, 3), (128, 64, 4, 3), (256, 64, 16, 2)]


def time_cfg(q, k, pe, v, cfg) -> float:
    mp.FLASH_CONFIG = cfg
    run = lambda: mp._flash_attn(q, k, pe, v, (T,), (T,), 0.1, True, q.dtype)
    for _ in range(2):
        run()
    rounds = []
    for _ in range(3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(10):
            run()
        b.record()
        b.synchronize()
        rounds.append(a.elapsed_time(b) / 10)
    return statistics.median(rounds)


shipped = mp.FLASH_CONFIG
for h in (128, 16):
    g = torch.Generator(device="cuda").manual_seed(h)
    q = torch.randn(T, h, 192, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(T, h, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    pe = torch.randn(T, 1, 64, device="cuda", dtype=torch.bfloat16, generator=g).expand(-1, h, -1)
    v = torch.randn(T, h, 128, device="cuda", dtype=torch.bfloat16, generator=g)
    flops = 2 * (T * (T + 1) / 2) * h * (192 + 128)
    ref = None
    for cfg in CONFIGS:
        try:
            ms = time_cfg(q, k, pe, v, cfg)
        except Exception as exc:  # noqa: BLE001
            print(f"H={h} {cfg}: {type(exc).__name__}: {str(exc)[:80]}", flush=True)
            continue
        if cfg == shipped:
            ref = ms
        print(f"H={h} {cfg}: {ms * 1e3:8.1f} us {flops / ms / 1e9:6.0f} TFLOP/s"
              + (f" ({ref / ms:.2f}x the shipped)" if ref else ""), flush=True)
mp.FLASH_CONFIG = shipped
