"""`mlaserve bench kernels`: every Triton kernel at DeepSeek shapes on the GPU, beside the measured ceilings.

Prints (and with --output writes) a markdown table: time (CUDA-graph replays, L2 flushed), achieved TB/s and
TFLOP/s, the fraction of the ceiling that bounds the kernel (copy bandwidth, bf16 or fp8 matmul rate, measured
in the same run), the target fraction from the issue, the floor (the larger of bytes over bandwidth and FLOPs
over matmul rate) and the fraction of it reached, and the max relative error against the kernel's `_ref`.
"""
from __future__ import annotations

import argparse
import datetime
import importlib
import traceback

import torch

from mlaserve.bench.timing import Ceilings

MODULES = ("mla_decode", "mla_prefill", "fused_moe", "fp8_gemm", "quant", "small_ops")


def floor_ms(r: dict, ceil: Ceilings) -> float | None:
    """The row's floor: the larger of its bytes over copy bandwidth and its FLOPs over the matmul rate of its
    operand type (`mma`: "fp8" or "bf16", the default)."""
    if r.get("tbps") is None or r.get("tflops") is None:
        return None
    rate = ceil["fp8_flops"] if r.get("mma") == "fp8" or r["bound"] == "fp8" else ceil["bf16_flops"]
    secs = r["ms"] * 1e-3
    return max(r["tbps"] * 1e12 * secs / ceil["copy_bps"], r["tflops"] * 1e12 * secs / rate) * 1e3


def fmt_row(r: dict, ceil: Ceilings) -> str:
    def f(v, spec):
        return "-" if v is None else format(v, spec)
    target = "-" if r.get("target") is None else f"{r['target']:.0%}"
    met = "" if r.get("target") is None else (" met" if r["frac"] >= r["target"] else " MISSED")
    floor = floor_ms(r, ceil)
    of_floor = None if floor is None else floor / r["ms"]
    return (f"| {r['kernel']} | {r['shape']} | {f(r['ms'] * 1e3, '.1f')} | {f(r.get('tbps'), '.2f')} | "
            f"{f(r.get('tflops'), '.1f')} | {r['bound']} | {r['frac']:.1%} | {target}{met} | "
            f"{f(None if floor is None else floor * 1e3, '.1f')} | {f(of_floor, '.0%')} | "
            f"{f(r.get('err'), '.1e')} | {'ok' if r.get('ok') else 'FAIL'} |")


HEADER = ("| kernel | shape | us | TB/s | TFLOP/s | bound | of ceiling | target | floor us | of floor | "
          "max rel err | check |\n|---|---|---|---|---|---|---|---|---|---|---|---|")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mlaserve bench kernels", description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="+", choices=MODULES, default=list(MODULES))
    ap.add_argument("--quick", action="store_true", help="a few shapes per kernel")
    ap.add_argument("--output", help="append the markdown table to this file")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("mlaserve bench kernels needs a CUDA GPU")
        return 1
    ceil = Ceilings.measure()
    name = torch.cuda.get_device_name()
    lines = [f"## bench kernels on {name}, {datetime.date.today()} (torch {torch.__version__})", "",
             f"Ceilings measured in this run: copy {ceil['copy_bps'] / 1e12:.2f} TB/s, "
             f"bf16 matmul {ceil['bf16_flops'] / 1e12:.0f} TFLOP/s, fp8 matmul {ceil['fp8_flops'] / 1e12:.0f} TFLOP/s.",
             "", HEADER]
    print("\n".join(lines), flush=True)
    failed = 0
    for mod in args.only:
        try:
            for row in importlib.import_module(f"mlaserve.bench.kernel_cases.{mod}").cases(ceil, args.quick):
                line = fmt_row(row, ceil)
                failed += not row.get("ok", False)
                lines.append(line)
                print(line, flush=True)
        except Exception as e:  # noqa: BLE001 - one broken kernel must not hide the others
            failed += 1
            line = f"| {mod} | ERROR: {type(e).__name__}: {str(e)[:200]} | | | | | | | | | | FAIL |"
            lines.append(line)
            print(line, flush=True)
            traceback.print_exc()
        torch.cuda.empty_cache()
    if args.output:
        with open(args.output, "a") as f:
            f.write("\n".join(lines) + "\n\n")
    return 1 if failed else 0
