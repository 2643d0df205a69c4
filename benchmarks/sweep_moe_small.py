"""V2-Lite's fused MoE at decode token counts, the two GEMMs tiled apart (issue 15), on the GPU.

The model's own call: 66 stacked bf16 experts (64 routed + 2 shared), 6 routed + 2 shared slots a token; one token
runs `fused_moe_norm` (combine and next norm in the second GEMM), more run `fused_moe` and `sum_dim1`. Timed as in
the decode graph: CHAIN calls back to back in one CUDA graph, each on the next of WEIGHT_SETS expert stacks (past
the L2), us a call. `tune fused-moe` timed one config for both GEMMs with the L2 flushed and never a BLOCK_SIZE_N
of 32; here the first GEMM's tiles are swept with the second's at the table's, then the second's with the first's
at its best, then the table's config and the best pair are timed alternately (REPEATS each).

Writes the table with the best pairs (a "down" entry where the second GEMM's tiles differ) to --out-table.
Usage: PYTHONPATH=$PWD python3 benchmarks/sweep_moe_small.py --tokens 1 2 4 8 --out-table /tmp/new.json
"""
from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import torch

from chain_timer import chain_us

from mlaserve.kernels import fused_moe as fm
from mlaserve.tools.tuning import precompile

E_ROUTED, N_SHARED, TOP_K, HIDDEN, INTER = 64, 2, 6, 2048, 1408
CHAIN, WEIGHT_SETS, REPEATS = 16, 4, 3
SMEM = 200 * 1024
KEYS = ("BLOCK_SIZE_N", "BLOCK_SIZE_K", "num_warps", "num_stages")


def candidates(tokens: int, down: bool) -> list[dict]:
    """Tiles (BLOCK_SIZE_N, BLOCK_SIZE_K, num_warps, num_stages) whose stages fit shared memory (BLOCK_SIZE_M 16)."""
    if tokens == 1:
        space = ((32, 64, 128, 256) if down else (32, 64, 128), (64, 128, 256), (2, 4, 8), (2, 3, 4, 5))
    else:
        space = ((32, 64, 128), (64, 128), (4,), (3, 4))
    return [dict(zip(KEYS, c)) for c in itertools.product(*space) if (16 * c[1] + c[1] * c[0]) * 2 * c[3] <= SMEM]


def table_config(tokens: int) -> dict:
    return fm.get_moe_config(E_ROUTED, INTER, "bf16", tokens)


def case(tokens: int, sets: int, device: str = "cuda") -> dict:
    e = E_ROUTED + N_SHARED
    ws = [dict(w13=torch.randn(e, 2 * INTER, HIDDEN, device=device, dtype=torch.bfloat16) * HIDDEN ** -0.5,
               w2=torch.randn(e, HIDDEN, INTER, device=device, dtype=torch.bfloat16) * INTER ** -0.5)
          for _ in range(sets)]
    logits = torch.randn(tokens, E_ROUTED, device=device)
    weights, ids = logits.softmax(-1).topk(TOP_K, dim=-1)
    shared = torch.arange(E_ROUTED, e, device=device).expand(tokens, N_SHARED)
    ids = torch.cat([ids, shared], dim=1).to(torch.int32)
    weights = torch.cat([weights, torch.ones(tokens, N_SHARED, device=device)], dim=1)
    x = torch.randn(tokens, HIDDEN, device=device, dtype=torch.bfloat16)
    return dict(ws=ws, ids=ids, weights=weights, x=x, residual=torch.randn_like(x),
                norm_w=torch.ones(HIDDEN, device=device, dtype=torch.bfloat16),
                sync=torch.zeros(HIDDEN // 16 + 1, dtype=torch.int32, device=device))


def call(c: dict, w: dict, cfg: dict) -> None:
    kw = dict(topk_weights=c["weights"], topk_ids=c["ids"], config=cfg, num_routed_experts=E_ROUTED, sync=c["sync"])
    if c["x"].shape[0] == 1:
        fm.fused_moe_norm(c["x"], w["w13"], w["w2"], residual=c["residual"], norm_weight=c["norm_w"], eps=1e-6, **kw)
    else:
        fm.fused_moe(c["x"], w["w13"], w["w2"], **kw)


def _compile(job: tuple[int, str]) -> None:
    # a precompile worker: one call of this variant fills Triton's cache for the timing process
    tokens, cfg = job
    c = case(tokens, 1)
    call(c, c["ws"][0], json.loads(cfg))


def timed(c: dict, cfg: dict) -> float:
    return chain_us([lambda w=c["ws"][j % len(c["ws"])]: call(c, w, cfg) for j in range(CHAIN)])


def timed_all(c: dict, cfgs: list[dict]) -> list[tuple[float, dict]]:
    """(us, cfg) fastest first; a variant that cannot run (shared memory, registers) is left out and named."""
    rows = []
    for cfg in cfgs:
        try:
            rows.append((timed(c, cfg), cfg))
        except Exception as exc:  # noqa: BLE001 -- out of resources for this tile
            print(f"  skip {json.dumps(cfg)}: {type(exc).__name__}")
    return sorted(rows, key=lambda r: r[0])


def with_down(first: dict, down: dict) -> dict:
    return {**first, "down": {k: down[k] for k in KEYS}}


def sweep(tokens: int) -> dict:
    base = table_config(tokens)
    c = case(tokens, WEIGHT_SETS)
    rows = timed_all(c, [with_down({**base, **cand}, base) for cand in candidates(tokens, False)])
    print(f"T={tokens} first GEMM (second at the table's {[base[k] for k in KEYS]}), best 5 of {len(rows)}:")
    for us, cfg in rows[:5]:
        print(f"    {us:7.2f} us  {[cfg[k] for k in KEYS]}")
    first = {k: v for k, v in rows[0][1].items() if k != "down"}
    rows = timed_all(c, [with_down(first, cand) for cand in candidates(tokens, True)])
    print(f"T={tokens} second GEMM (first at {[first[k] for k in KEYS]}), best 5 of {len(rows)}:")
    for us, cfg in rows[:5]:
        print(f"    {us:7.2f} us  {[cfg['down'][k] for k in KEYS]}")
    best = rows[0][1]
    if all(best["down"][k] == first[k] for k in KEYS):
        best.pop("down")
    a, b = [], []
    for _ in range(REPEATS):
        a.append(timed(c, base))
        b.append(timed(c, best))
    x = c["x"]
    kw = dict(topk_weights=c["weights"], topk_ids=c["ids"], num_routed_experts=E_ROUTED)
    want = fm.fused_moe(x, **c["ws"][0], config=base, **kw).float()
    got = fm.fused_moe(x, **c["ws"][0], config=best, **kw).float()
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < 2e-2, f"T={tokens}: best config's output differs from the table's by {err}"
    print(f"T={tokens} table {json.dumps(base)}: {' / '.join(f'{t:.2f}' for t in a)} us")
    print(f"T={tokens} best  {json.dumps(best)}: {' / '.join(f'{t:.2f}' for t in b)} us (rel diff {err:.1e})",
          flush=True)
    return best if min(b) < min(a) else base


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--out-table", type=Path, required=True)
    args = p.parse_args()
    jobs = {(t, json.dumps(with_down({**table_config(t), **cand}, table_config(t)), sort_keys=True))
            for t in args.tokens for cand in candidates(t, False)}
    jobs |= {(t, json.dumps(with_down(table_config(t), cand), sort_keys=True))
             for t in args.tokens for cand in candidates(t, True)}
    print(f"fused MoE sweep on {torch.cuda.get_device_name()}: compiling {len(jobs)} variants", flush=True)
    print(f"  {precompile(_compile, sorted(jobs))} did not run", flush=True)
    path = fm.CONFIG_DIR / fm.config_file_name(E_ROUTED, INTER, "bf16", fm.gpu_name())
    table = json.loads(path.read_text())
    for t in args.tokens:
        table[str(t)] = sweep(t)
    args.out_table.write_text(json.dumps(table, indent=2) + "\n")
    print(f"wrote {args.out_table} (from {path.name})")


if __name__ == "__main__":
    main()
