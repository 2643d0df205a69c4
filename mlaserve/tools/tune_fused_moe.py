"""`mlaserve tune fused-moe`: search `fused_moe` tile configs per token count on this GPU and write the JSON
that `get_moe_config` reads (E=..,N=..,device_name=..,dtype=..,block_shape=[128, 128].json).
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path
from typing import Callable, Iterator

import torch

from mlaserve.bench.kernel_cases.fused_moe import MoeShape, make_weights, route
from mlaserve.bench.timing import time_cuda
from mlaserve.kernels.fused_moe import CONFIG_DIR, config_file_name, fused_moe

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 1536, 2048, 3072, 4096)
SMEM_BYTES = 200 * 1024          # leave headroom under the H100/H200 227 KiB per block


def shape_from_hf_config(path: Path, tp_size: int, dtype: str) -> MoeShape:
    """Routed-expert shape of one TP rank from a Hugging Face config.json (I = moe_intermediate_size / tp)."""
    d = json.loads(Path(path).read_text())
    inter = d["moe_intermediate_size"]
    assert inter % tp_size == 0, f"moe_intermediate_size={inter} is not divisible by --tp-size {tp_size}"
    return MoeShape(d.get("_name_or_path", Path(path).stem), d["n_routed_experts"], d["num_experts_per_tok"],
                    d["hidden_size"], inter // tp_size, dtype == "fp8_w8a8", d.get("n_group") or 1,
                    d.get("topk_group") or 1)


def search_space(tokens: int, s: MoeShape) -> Iterator[dict]:
    """Candidate configs, pruned: BLOCK_SIZE_M near the rows per expert, tiles fitting shared memory."""
    rows_per_expert = max(1, tokens * s.top_k // s.num_experts)
    max_bm = max(16, min(128, 2 ** math.ceil(math.log2(rows_per_expert))))
    elt = 1 if s.fp8 else 2
    group_sizes = (1,) if rows_per_expert <= 16 else (1, 16, 32, 64)     # swizzle only helps many M blocks
    for bm, bn, bk, gm, warps, stages in itertools.product(
            (16, 32, 64, 128), (32, 64, 128, 256), (128,) if s.fp8 else (64, 128, 256),
            group_sizes, (4, 8), (2, 3, 4, 5)):
        if bm > max_bm or (bm * bk + bk * bn) * elt * stages > SMEM_BYTES:
            continue
        cfg = dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=gm, num_warps=warps,
                   num_stages=stages)
        for fuse in ((True, False) if s.fp8 else (None,)):
            yield cfg if fuse is None else {**cfg, "FUSE_QUANT": fuse}


def benchmark(s: MoeShape, tokens: int, weights: dict[str, torch.Tensor]) -> Callable[[dict], float]:
    x = torch.randn(tokens, s.hidden_size, device="cuda", dtype=torch.bfloat16)
    topk_weights, topk_ids = route(s, tokens)
    out = torch.empty_like(x)

    def run(cfg: dict) -> float:
        return time_cuda(lambda: fused_moe(x, **weights, topk_weights=topk_weights, topk_ids=topk_ids,
                                           config=cfg, out=out), warmup=2, iters=10)
    return run


def tune(s: MoeShape, batch_sizes: list[int], bench: Callable[[int], Callable[[dict], float]]) -> dict[str, dict]:
    """Best config per batch size; `bench(tokens)` returns a timer `cfg -> ms` (raises if cfg cannot run)."""
    best: dict[str, dict] = {}
    for tokens in batch_sizes:
        timer = bench(tokens)
        results = []
        for cfg in search_space(tokens, s):
            try:
                results.append((timer(cfg), cfg))
            except Exception as exc:  # noqa: BLE001 -- out of shared memory / registers: skip the config
                print(f"  skip {cfg}: {type(exc).__name__}", file=sys.stderr)
        assert results, f"no config ran for T={tokens}"
        ms, cfg = min(results, key=lambda r: r[0])
        print(f"T={tokens}: {ms:.4f} ms {cfg}")
        best[str(tokens)] = cfg
    return best


def write_configs(best: dict[str, dict], s: MoeShape, dtype: str, out_dir: Path,
                  device_name: str | None = None) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / config_file_name(s.num_experts, s.moe_intermediate_size, dtype, device_name)
    ordered = dict(sorted(best.items(), key=lambda kv: int(kv[0])))
    path.write_text(json.dumps(ordered, indent=2) + "\n")
    return path


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="mlaserve tune fused-moe", description=__doc__)
    p.add_argument("--model-config", type=Path, required=True, help="a Hugging Face config.json")
    p.add_argument("--tp-size", type=int, default=1, help="tensor-parallel size (I per rank = I / tp)")
    p.add_argument("--dtype", choices=("fp8_w8a8", "bf16"), default="bf16")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=list(DEFAULT_BATCH_SIZES))
    p.add_argument("--out-dir", type=Path, default=CONFIG_DIR)
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("tune fused-moe needs a CUDA GPU", file=sys.stderr)
        return 1
    s = shape_from_hf_config(args.model_config, args.tp_size, args.dtype)
    weights = make_weights(s)
    best = tune(s, args.batch_sizes, lambda tokens: benchmark(s, tokens, weights))
    print(f"wrote {write_configs(best, s, args.dtype, args.out_dir)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
