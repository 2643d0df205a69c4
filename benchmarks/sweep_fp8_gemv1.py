"""One-row block-FP8 linears on the GPU: `fp8_gemv1` (CUDA cores, weights in registers) against `fp8_gemv` (tensor
cores through shared memory), at DeepSeek-V3's decode shapes, as a decode graph runs them.

Each timing is a CUDA graph of C calls back to back, each on its own weight (C sized so the weights exceed the L2
several times over), PDL on where the kernels use it, the L2 flushed before each replay; us a call is the replay's
median over C. TB/s counts weight bytes with their scales; "of copy" is that over the device-to-device copy rate of
the same run. Rows: the shipped `fp8_gemv` rule, it at 8 warps, and `fp8_gemv1` over block_n x programs per SM x
warps, with its rule's config marked. Then the 18 calls of V3 4 layers at bs 1 (three dense layers, one MoE layer)
in one graph: fp8_gemv, fp8_gemv1's rule, and the fastest fp8_gemv1 config of each shape. Every config is checked
against `fp8_linear_ref` first (max |y - ref| / max |ref|, fp32 output).
Usage: PYTHONPATH=$PWD python3 benchmarks/sweep_fp8_gemv1.py
"""
from __future__ import annotations

import sys

import torch
import triton

from mlaserve.bench.timing import measure_copy_bandwidth, time_cuda
from mlaserve.kernels import pdl
from mlaserve.kernels.fp8_gemm import fp8_linear_ref
from mlaserve.kernels.fp8_gemv import Fp8GemvConfig, fp8_gemv, fp8_gemv1, fp8_gemv1_config, fp8_gemv_config
from mlaserve.kernels.quant import block_quant_fp8_ref

# name: (N, K, calls in V3 4 layers at bs 1)
V3_LINEARS = {"q_a+kv_a": (2112, 7168, 4), "q_b": (24576, 1536, 4), "o_proj": (7168, 16384, 4),
              "dense gate_up": (36864, 7168, 3), "dense down": (7168, 18432, 3), "shared gate_up": (4096, 7168, 1),
              "shared down": (7168, 2048, 1)}
DEV = "cuda"
L2_TIMES = 6                     # the weights of one timed graph: at least this many L2s (50 MB on an H100)


def weight_bytes(n: int, k: int) -> int:
    return n * k + triton.cdiv(n, 128) * triton.cdiv(k, 128) * 4


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def gemv1_configs(n: int, k: int, sms: int) -> list[Fp8GemvConfig]:
    out = []
    for block_n in (64, 128):
        for pps in (2, 3, 4, 6):
            for warps in (4, 8):
                cfg = fp8_gemv1_config(n, k, sms, block_n, pps)._replace(num_warps=warps)
                if cfg not in out:
                    out.append(cfg)
    return out


def time_calls(fn, xs, ws) -> float:
    """us a call of fn(x, w_q, w_s) over the weights `ws`, one graph of them all."""
    return time_cuda(lambda: [fn(xs, w_q, w_s) for w_q, w_s in ws], iters=30) * 1e3 / len(ws)


def sweep_shape(name: str, n: int, k: int, copy_bps: float, sms: int, l2: int) -> dict:
    torch.manual_seed(0)
    calls = max(2, triton.cdiv(L2_TIMES * l2, weight_bytes(n, k)))
    ws = [block_quant_fp8_ref(torch.randn(n, k, device=DEV) * k ** -0.5) for _ in range(calls)]
    x = torch.randn(1, k, device=DEV, dtype=torch.bfloat16)
    ref = fp8_linear_ref(x, *ws[0], out_dtype=torch.float32)
    nbytes = weight_bytes(n, k)
    rows = []

    def row(label: str, fn) -> float:
        err = rel_err(fn(x, *ws[0]), ref)
        us = time_calls(fn, x, ws)
        rows.append((us, label))
        print(f"  {label:44} {us:8.2f} us {nbytes / us / 1e6:6.2f} TB/s {nbytes / us * 1e6 / copy_bps:5.0%}  "
              f"err {err:.1e}", flush=True)
        return us

    print(f"\n{name}: N {n} K {k}, {calls} calls of {nbytes / 1e6:.1f} MB (floor {nbytes / copy_bps * 1e6:.2f} us)")
    base = fp8_gemv_config(n, k, sms)
    t_gemv = row(f"fp8_gemv {tuple(base)}", lambda a, q, s: fp8_gemv(a, q, s, out_dtype=torch.float32))
    w8 = base._replace(num_warps=8)
    row(f"fp8_gemv {tuple(w8)}", lambda a, q, s: fp8_gemv(a, q, s, out_dtype=torch.float32, config=w8))
    rule = fp8_gemv1_config(n, k, sms)
    best = (float("inf"), None)
    t_rule = None
    for cfg in gemv1_configs(n, k, sms):
        us = row(f"fp8_gemv1 {tuple(cfg)}{'  <- rule' if cfg == rule else ''}",
                 lambda a, q, s, c=cfg: fp8_gemv1(a, q, s, out_dtype=torch.float32, config=c))
        t_rule = us if cfg == rule else t_rule
        best = min(best, (us, cfg), key=lambda r: r[0])
    if t_rule is None:
        t_rule = row(f"fp8_gemv1 {tuple(rule)}  <- rule",
                     lambda a, q, s: fp8_gemv1(a, q, s, out_dtype=torch.float32, config=rule))
    print(f"  -> fp8_gemv1 rule {t_gemv / t_rule:.2f}x fp8_gemv; best {tuple(best[1])} {t_gemv / best[0]:.2f}x")
    del ws
    torch.cuda.empty_cache()
    return {"gemv": base, "rule": rule, "best": best[1]}


def mix(picks: dict, copy_bps: float) -> None:
    """The 18 calls of V3 4 layers at bs 1, each on its own weight, in one graph, per path."""
    torch.manual_seed(0)
    calls = []
    for name, (n, k, count) in V3_LINEARS.items():
        for _ in range(count):
            calls.append((name, block_quant_fp8_ref(torch.randn(n, k, device=DEV) * k ** -0.5),
                          torch.randn(1, k, device=DEV, dtype=torch.bfloat16)))
    nbytes = sum(count * weight_bytes(n, k) for n, k, count in V3_LINEARS.values())
    print(f"\nV3 4 layers bs 1: {len(calls)} calls, {nbytes / 1e9:.2f} GB, floor {nbytes / copy_bps * 1e6:.0f} us")
    paths = {"fp8_gemv": lambda name, x, w: fp8_gemv(x, *w),
             "fp8_gemv1 rule": lambda name, x, w: fp8_gemv1(x, *w, config=picks[name]["rule"]),
             "fp8_gemv1 best per shape": lambda name, x, w: fp8_gemv1(x, *w, config=picks[name]["best"])}
    for label, fn in paths.items():
        us = time_cuda(lambda: [fn(name, x, w) for name, w, x in calls], iters=30) * 1e3
        print(f"  {label:28} {us:8.1f} us {nbytes / us / 1e6:6.2f} TB/s {nbytes / us * 1e6 / copy_bps:5.0%}",
              flush=True)


def main() -> int:
    if not torch.cuda.is_available():
        print("sweep_fp8_gemv1 needs a CUDA GPU")
        return 1
    copy_bps = measure_copy_bandwidth()
    props = torch.cuda.get_device_properties(0)
    l2 = getattr(props, "L2_cache_size", 50 * 2**20)
    print(f"one-row fp8 linears on {props.name} ({props.multi_processor_count} SMs, L2 {l2 / 2**20:.0f} MB), torch "
          f"{torch.__version__}, triton {triton.__version__}, PDL {'on' if pdl.active(torch.device(DEV)) else 'off'}; "
          f"copy {copy_bps / 1e12:.2f} TB/s")
    picks = {name: sweep_shape(name, n, k, copy_bps, props.multi_processor_count, l2)
             for name, (n, k, _) in V3_LINEARS.items()}
    for name, p in picks.items():
        print(f"PICK {name}: rule {tuple(p['rule'])} best {tuple(p['best'])}")
    mix(picks, copy_bps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
