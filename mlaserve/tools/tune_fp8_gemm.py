"""Tune `fp8_gemm` tile configs per (N, K) and batch size M on the current GPU; writes kernels/configs/*.json.

Usage: python -m mlaserve.tools.tune_fp8_gemm [--shapes 7168,2048 ...] [--batch-sizes 1 16 ...] [--out-dir DIR]
"""
from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import triton

from mlaserve.bench.kernel_cases.fp8_gemm import V3_SHAPES
from mlaserve.kernels.fp8_gemm import CONFIG_DIR, config_file_name, current_device_name, fp8_gemm, fp8_gemm_ref
from mlaserve.kernels.quant import block_quant_fp8_ref, per_token_group_quant_fp8_ref
from mlaserve.tools.tuning import best_config, graph_timer, precompile

NUM_SMS = 132                    # split-K only while the output tiles leave SMs idle

BATCH_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]


def search_space(m: int, n: int, k: int) -> list[dict]:
    """Candidate configs for one M: skinny tiles with split-K for decode, big swizzled tiles for prefill."""
    k_tiles = -(-k // 128)
    if m <= 64:
        block_ms = [bm for bm in (16, 32, 64) if bm // 2 < max(m, 16)]
        space = itertools.product(block_ms, (32, 64, 128), (1,), (1, 2, 4, 8), (4,), (3, 4, 5))
    elif m <= 512:
        space = itertools.product((32, 64, 128), (64, 128), (1, 8), (1,), (4,), (3, 4))
    else:
        space = itertools.product((64, 128), (128, 256), (8, 32), (1,), (4, 8), (3, 4))
    keys = ("BLOCK_M", "BLOCK_N", "GROUP_M", "SPLIT_K", "num_warps", "num_stages")
    configs = [dict(zip(keys, c), BLOCK_K=128) for c in space]
    return [c for c in configs if c["SPLIT_K"] <= max(1, k_tiles // 2) and _smem_bytes(c) <= 200 * 1024
            and (c["SPLIT_K"] == 1 or triton.cdiv(m, c["BLOCK_M"]) * triton.cdiv(n, c["BLOCK_N"]) < 2 * NUM_SMS)]


def _smem_bytes(cfg: dict) -> int:
    return (cfg["BLOCK_M"] + cfg["BLOCK_N"]) * cfg["BLOCK_K"] * cfg["num_stages"]      # fp8 A and B stages


_WORKER_OPERANDS: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _compile_job(job: tuple[int, int, int, dict]) -> None:
    # Runs in a precompile worker: the timing process's call on random operands of the same shape.
    m, n, k, cfg = job
    if (n, k) not in _WORKER_OPERANDS:
        _WORKER_OPERANDS[n, k] = block_quant_fp8_ref(torch.randn(n, k, device="cuda") * 0.02)
    x_q, x_s = per_token_group_quant_fp8_ref(torch.randn(m, k, device="cuda"))
    fp8_gemm(x_q, x_s, *_WORKER_OPERANDS[n, k], config=cfg)


def tune_one(m: int, n: int, k: int, w_q: torch.Tensor, w_s: torch.Tensor) -> tuple[dict, float]:
    """Fastest correct config for one M (and its median time in ms)."""
    x_q, x_s = per_token_group_quant_fp8_ref(torch.randn(m, k, device="cuda"))
    ref = fp8_gemm_ref(x_q, x_s, w_q, w_s, out_dtype=torch.float32)

    def timer(cfg: dict) -> float:
        y = fp8_gemm(x_q, x_s, w_q, w_s, config=cfg)
        if (y.float() - ref).abs().max() > 1e-2 * ref.abs().max():
            raise ValueError("wrong result")
        return graph_timer(lambda: fp8_gemm(x_q, x_s, w_q, w_s, config=cfg))
    return best_config(search_space(m, n, k), timer, f"M={m} N={n} K={k}")


def tune_shape(n: int, k: int, batch_sizes: list[int]) -> dict[str, dict]:
    w_q, w_s = block_quant_fp8_ref(torch.randn(n, k, device="cuda") * 0.02)
    table = {}
    for m in batch_sizes:
        cfg, ms = tune_one(m, n, k, w_q, w_s)
        print(f"N={n} K={k} M={m}: {ms * 1e3:.1f} us, {2 * m * n * k / ms / 1e9:.0f} TFLOP/s, "
              f"{n * k / ms / 1e9:.2f} TB/s weights  {cfg}")
        table[str(m)] = cfg
    return table


def parse_shape(text: str) -> tuple[int, int]:
    n, k = (int(v) for v in text.split(","))
    return n, k


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tune_fp8_gemm", description=__doc__)
    parser.add_argument("--shapes", nargs="+", type=parse_shape, default=V3_SHAPES, metavar="N,K")
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=BATCH_SIZES, metavar="M")
    parser.add_argument("--out-dir", type=Path, default=CONFIG_DIR)
    parser.add_argument("--jobs", type=int, default=None, help="compile processes (default: CPUs - 1, at most 16)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("tune_fp8_gemm: needs a CUDA GPU", file=sys.stderr)
        return 1
    args.out_dir.mkdir(parents=True, exist_ok=True)
    # one compile job per config and specialisation (integer arguments: == 1, % 16; K % BLOCK_K)
    jobs = list({(m == 1, m % 16 == 0, n % 16 == 0, k % 128 == 0, json.dumps(cfg, sort_keys=True)): (m, n, k, cfg)
                 for n, k in args.shapes for m in args.batch_sizes for cfg in search_space(m, n, k)}.values())
    print(f"compiling {len(jobs)} candidates in {args.jobs or 'auto'} processes", flush=True)
    print(f"  {precompile(_compile_job, jobs, args.jobs)} candidates did not run", flush=True)
    for n, k in args.shapes:
        path = args.out_dir / config_file_name(n, k, current_device_name())
        path.write_text(json.dumps(tune_shape(n, k, args.batch_sizes), indent=2) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
