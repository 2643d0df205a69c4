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

from mlaserve.bench.kernel_cases.fused_moe import TOL as bench_tol
from mlaserve.bench.kernel_cases.fused_moe import MoeShape, make_weights, route
from mlaserve.kernels.fused_moe import CONFIG_DIR, DOWN_KEYS, config_file_name, fused_moe, fused_moe_ref
from mlaserve.tools.tuning import best_config, graph_timer, precompile

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
SMEM_BYTES = 200 * 1024          # leave headroom under the H100/H200 227 KiB per block
PRECOMPILE_EXPERTS = 16          # workers compile with this many experts: same kernels, little memory
DOWN_MARGIN = 0.03               # a "down" entry is kept only when it is this much faster (the timer's spread)


def shape_from_hf_config(path: Path, tp_size: int, dtype: str, ep_size: int = 1) -> MoeShape:
    """Routed-expert shape of one rank from a Hugging Face config.json: I = moe_intermediate_size / tp and
    E = n_routed_experts, or under expert parallelism (ep > 1) E / ep whole experts (I not split).

    E is the key the model's calls read (its stacked shared experts are not counted)."""
    d = json.loads(Path(path).read_text())
    inter, n = d["moe_intermediate_size"], d["n_routed_experts"]
    if n % ep_size or tp_size % ep_size:
        raise ValueError(f"--ep-size {ep_size}: must divide n_routed_experts ({n}) and --tp-size ({tp_size}), as "
                         "in serving")
    split = tp_size // ep_size                                    # each expert set's ranks split its experts
    if inter % split:
        raise ValueError(f"--tp-size {tp_size}: moe_intermediate_size {inter} is not divisible by {split}")
    return MoeShape(d.get("_name_or_path", Path(path).stem), n // ep_size, d["num_experts_per_tok"],
                    d["hidden_size"], inter // split, dtype == "fp8_w8a8", d.get("n_group") or 1,
                    d.get("topk_group") or 1, ep_size)


def search_space(tokens: int, s: MoeShape) -> Iterator[dict]:
    """Candidate configs, pruned: BLOCK_SIZE_M between an eighth of and the rows per expert (powers of two),
    swizzle and 8 warps only for tall tiles, fused activation quantisation (fp8) only for few tokens, tiles
    fitting shared memory."""
    rows = 2 ** math.ceil(math.log2(max(1, tokens * s.top_k / (s.num_experts * s.ep))))   # per expert
    elt = 1 if s.fp8 else 2
    for bm, bn, bk, gm, warps, stages in itertools.product(
            (16, 32, 64, 128), (64, 128, 256), (128,) if s.fp8 else (64, 128), (1, 16), (4, 8), (3, 4, 5)):
        if not max(16, rows // 8) <= bm <= max(16, min(128, rows)):
            continue
        if (gm > 1 or warps > 4) and bm < 64 or bm >= 64 and (bn < 128 or stages > 4):
            continue
        if (bm * bk + bk * bn) * elt * stages > SMEM_BYTES:
            continue
        cfg = dict(BLOCK_SIZE_M=bm, BLOCK_SIZE_N=bn, BLOCK_SIZE_K=bk, GROUP_SIZE_M=gm, num_warps=warps,
                   num_stages=stages)
        for fuse in ((True, False) if s.fp8 and tokens <= 256 else (False,) if s.fp8 else (None,)):
            yield cfg if fuse is None else {**cfg, "FUSE_QUANT": fuse}


def down_space(cfg: dict, tokens: int, s: MoeShape) -> Iterator[dict]:
    """The second GEMM's own tiles for a chosen config: each candidate of `search_space` that shares cfg's
    BLOCK_SIZE_M, GROUP_SIZE_M and FUSE_QUANT (both GEMMs walk the same row blocks) and differs in a DOWN_KEYS
    value, as cfg plus a "down" entry of those keys."""
    seen = set()
    for c in search_space(tokens, s):
        if any(c.get(k) != cfg.get(k) for k in ("BLOCK_SIZE_M", "GROUP_SIZE_M", "FUSE_QUANT")):
            continue
        down = {k: c[k] for k in sorted(DOWN_KEYS)}
        key = tuple(down.values())
        if key not in seen and any(down[k] != cfg[k] for k in DOWN_KEYS):
            seen.add(key)
            yield {**cfg, "down": down}


_WORKER_WEIGHTS: dict[MoeShape, dict[str, torch.Tensor]] = {}


def _compile_job(job: tuple[MoeShape, int, dict]) -> None:
    # Runs in a precompile worker: the same call as the timing process, on PRECOMPILE_EXPERTS experts.
    s, tokens, cfg = job
    small = s._replace(num_experts=min(s.num_experts, PRECOMPILE_EXPERTS), n_group=1, topk_group=1, ep=1)
    if small not in _WORKER_WEIGHTS:
        _WORKER_WEIGHTS[small] = make_weights(small)
    x = torch.randn(tokens, s.hidden_size, device="cuda", dtype=torch.bfloat16)
    topk_ids = torch.rand(tokens, small.num_experts, device="cuda").topk(s.top_k, dim=1).indices.to(torch.int32)
    topk_weights = torch.rand(tokens, s.top_k, device="cuda")
    fused_moe(x, **_WORKER_WEIGHTS[small], topk_weights=topk_weights, topk_ids=topk_ids, config=cfg)


def benchmark(s: MoeShape, tokens: int, weights: dict[str, torch.Tensor]) -> Callable[[dict], float]:
    x = torch.randn(tokens, s.hidden_size, device="cuda", dtype=torch.bfloat16)
    topk_weights, topk_ids = route(s, tokens)
    out = torch.empty_like(x)

    def run(cfg: dict) -> float:
        return graph_timer(lambda: fused_moe(x, **weights, topk_weights=topk_weights, topk_ids=topk_ids,
                                             config=cfg, out=out))
    return run


def tune(s: MoeShape, batch_sizes: list[int], bench: Callable[[int], Callable[[dict], float]],
         down_pass: bool = True) -> dict[str, dict]:
    """Best config per batch size; `bench(tokens)` returns a timer `cfg -> ms` (raises if cfg cannot run).

    down_pass: then, the best config's BLOCK_SIZE_M kept, the second GEMM's own tiles (`down_space`); its "down"
    entry is kept when the call gets DOWN_MARGIN faster."""
    best: dict[str, dict] = {}
    for tokens in batch_sizes:
        timer = bench(tokens)
        cfg, ms = best_config(search_space(tokens, s), timer, f"T={tokens}")
        down = list(down_space(cfg, tokens, s)) if down_pass else []
        if down:
            try:
                cand, cand_ms = best_config(down, timer, f"T={tokens} down")
            except AssertionError:                        # none of them ran: keep the shared tiles
                cand, cand_ms = cfg, ms
            if cand_ms < ms * (1 - DOWN_MARGIN):
                cfg, ms = cand, cand_ms
        print(f"T={tokens}: {ms * 1e3:.1f} us {cfg}", flush=True)
        best[str(tokens)] = cfg
    return best


def check_config(s: MoeShape, tokens: int, weights: dict[str, torch.Tensor], cfg: dict) -> float:
    """Max error of `fused_moe` with `cfg` against `fused_moe_ref`, relative to max |ref|."""
    x = torch.randn(tokens, s.hidden_size, device="cuda", dtype=torch.bfloat16)
    topk_weights, topk_ids = route(s, tokens)
    got = fused_moe(x, **weights, topk_weights=topk_weights, topk_ids=topk_ids, config=cfg).float()
    ref = fused_moe_ref(x, **weights, topk_weights=topk_weights, topk_ids=topk_ids).float()
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()


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
    p.add_argument("--ep-size", type=int, default=1, help="expert-parallel size (E per rank = E / ep, I whole)")
    p.add_argument("--dtype", choices=("fp8_w8a8", "bf16"), default="bf16")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=list(DEFAULT_BATCH_SIZES))
    p.add_argument("--out-dir", type=Path, default=CONFIG_DIR)
    p.add_argument("--jobs", type=int, default=None, help="compile processes (default: CPUs - 1, at most 16)")
    p.add_argument("--no-down-pass", action="store_true",
                   help="one set of tiles for both GEMMs (default: then tune the second GEMM's apart)")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("tune fused-moe needs a CUDA GPU", file=sys.stderr)
        return 1
    try:
        s = shape_from_hf_config(args.model_config, args.tp_size, args.dtype, args.ep_size)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # the kernels do not specialise on the token count: one compile job per distinct config
    jobs = list({json.dumps(cfg, sort_keys=True): (s, t, cfg) for t in args.batch_sizes
                 for cfg in search_space(t, s)}.values())
    print(f"{s.name} E={s.num_experts} I={s.moe_intermediate_size} {args.dtype}: compiling {len(jobs)} "
          f"candidates in {args.jobs or 'auto'} processes", flush=True)
    failed = precompile(_compile_job, jobs, args.jobs)
    print(f"  {failed} candidates did not run", flush=True)
    weights = make_weights(s)
    best = tune(s, args.batch_sizes, lambda tokens: benchmark(s, tokens, weights), down_pass=not args.no_down_pass)
    tol = bench_tol["fp8" if s.fp8 else "bf16"]
    for tokens, cfg in best.items():
        err = check_config(s, int(tokens), weights, cfg)
        assert err <= tol, f"T={tokens}: the chosen {cfg} is wrong (rel err {err:.2e} > {tol})"
    print(f"wrote {write_configs(best, s, args.dtype, args.out_dir)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
