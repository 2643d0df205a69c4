"""The fused MoE's tiles at one token as the decode graph runs it (GPU): `fused_moe_norm` for each of a model's MoE
layers back to back in one CUDA graph (PDL as shipped), each layer its own weights, routed to top-k random experts
plus the shared ones, as `layers/moe.py` stacks them. The tuned tables were timed one call at a time with the L2
flushed and without the shared slots (`kernels/fused_moe.py`); this times the step's own conditions.

First the gate / up GEMM's tiles are swept with the second GEMM at the shipped entry, then the second GEMM's ("down")
with the first at the fastest. Prints us a layer beside the layer's weight bytes at the measured copy rate, and a
`PICK 1 {config} table-file` line for the fastest pair where it beats the shipped entry by --min-gain.

    python3 benchmarks/sweep_moe_decode_chain.py [--model-config CFG] [--rounds 3] [--picks FILE]
"""
from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics

import torch

from mlaserve.config import ModelConfig
from mlaserve.kernels import fused_moe as fm

from chain_timer import chain_us
from probe_kernel_chain import copy_rate

# (BLOCK_SIZE_N, BLOCK_SIZE_K, num_warps, num_stages) tried for each GEMM: 27 compiles each
TILES = list(itertools.product((32, 64, 128), (64, 128, 256), (4,), (3, 4, 5)))
DEVICE = "cuda"                                  # (a CPU smoke run under TRITON_INTERPRET=1 sets "cpu")


def layers(cfg: ModelConfig, seed: int) -> list[dict]:
    """One dict of fused_moe_norm operands per MoE layer: bf16 weights of the experts a token touches (top-k routed
    picked at random from 2 x top-k stacked routed experts, then the shared ones after them): fewer stacked experts
    than the model's, for memory; at one token the kernel's work is the same."""
    k, hid, inter = cfg.num_experts_per_tok, cfg.hidden_size, cfg.moe_intermediate_size
    stacked = 2 * k + cfg.n_shared_experts
    rng = random.Random(seed)
    out = []
    for _ in range(sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))):
        ids = rng.sample(range(2 * k), k) + list(range(2 * k, stacked))
        out.append(dict(
            x=torch.randn(1, hid, dtype=torch.bfloat16, device=DEVICE),
            w13=torch.randn(stacked, 2 * inter, hid, dtype=torch.bfloat16, device=DEVICE) * 0.02,
            w2=torch.randn(stacked, hid, inter, dtype=torch.bfloat16, device=DEVICE) * 0.02,
            weights=torch.cat([torch.rand(1, k, device=DEVICE), torch.ones(1, cfg.n_shared_experts, device=DEVICE)], 1),
            ids=torch.tensor([ids], dtype=torch.int32, device=DEVICE),
            residual=torch.randn(1, hid, dtype=torch.bfloat16, device=DEVICE),
            norm=torch.ones(hid, dtype=torch.bfloat16, device=DEVICE),
            sync=torch.zeros(hid // 32 + 2, dtype=torch.int32, device=DEVICE)))
    return out


def layer_us(ops: list[dict], config: dict, rounds: int) -> float:
    calls = [lambda o=o: fm.fused_moe_norm(o["x"], o["w13"], o["w2"], o["weights"], o["ids"], o["residual"], o["norm"],
                                          1e-6, sync=o["sync"], config=config) for o in ops]
    return statistics.median(chain_us(calls) for _ in range(rounds))


def sweep(name: str, config_of, ops: list[dict], floor: float, rounds: int) -> tuple[float, dict]:
    """(us a layer, config) of the fastest of TILES, each made a whole config by `config_of(tile dict)`; a tile
    that does not run (out of shared memory and the like) is printed and skipped."""
    results = []
    for bn, bk, warps, stages in TILES:
        c = config_of({"BLOCK_SIZE_N": bn, "BLOCK_SIZE_K": bk, "num_warps": warps, "num_stages": stages})
        try:
            us = layer_us(ops, c, rounds)
        except Exception as e:
            print(f"| {name} {bn} {bk} {warps} {stages} | failed: {type(e).__name__} |")
            continue
        results.append((us, c))
        print(f"| {name} BN {bn} BK {bk} warps {warps} stages {stages} | {us:.2f} | {floor / us:.0%} |", flush=True)
    return min(results, key=lambda r: r[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-config", default="mlaserve/tools/configs/deepseek-v2-lite.json")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--min-gain", type=float, default=0.03)
    ap.add_argument("--picks", default=None, help="append the PICK line here")
    a = ap.parse_args()
    seed = a.seed if a.seed is not None else random.randrange(1 << 30)
    cfg = ModelConfig.from_dict(json.loads(open(a.model_config).read()))
    assert not cfg.is_fp8, "bf16 experts only (V2 / V2-Lite shapes)"
    ops = layers(cfg, seed)
    table = fm.config_file_name(cfg.n_routed_experts, cfg.moe_intermediate_size, "bf16")
    shipped = fm.get_moe_config(cfg.n_routed_experts, cfg.moe_intermediate_size, "bf16", 1)
    rate = copy_rate()
    per_layer = (cfg.num_experts_per_tok + cfg.n_shared_experts) * 3 * cfg.hidden_size * cfg.moe_intermediate_size * 2
    floor = per_layer / rate * 1e6
    print(f"{torch.cuda.get_device_name()}: copy {rate / 1e12:.2f} TB/s; {len(ops)} MoE layers a graph, one token, "
          f"{per_layer / 1e6:.1f} MB a layer ({floor:.1f} us at the copy rate); seed {seed}; table {table}")
    print(f"shipped [1]: {shipped}")
    base = layer_us(ops, shipped, a.rounds)
    print(f"| shipped | {base:.2f} us a layer | {floor / base:.0%} of copy |")
    first, second = fm.split_config(shipped)
    shipped_down = {k: second[k] for k in fm.DOWN_KEYS}
    best_us, best = sweep("gate/up", lambda tile: {**first, **tile, "down": shipped_down}, ops, floor, a.rounds)
    down_us, down = sweep("down", lambda tile: {**best, "down": tile}, ops, floor, a.rounds)
    pick_us, pick = min((best_us, best), (down_us, down), key=lambda r: r[0])
    again_base, again_pick = layer_us(ops, shipped, a.rounds), layer_us(ops, pick, a.rounds)
    print(f"fastest: {pick}: {pick_us:.2f} us a layer; once more each: shipped {again_base:.2f}, fastest "
          f"{again_pick:.2f} ({floor / again_pick:.0%} of copy)")
    if again_pick < again_base * (1 - a.min_gain):
        line = f"PICK 1 {json.dumps(pick)} {table}"
        print(line)
        if a.picks:
            with open(a.picks, "a") as f:
                f.write(line + "\n")
    else:
        print(f"no pick: under {a.min_gain:.0%} faster than the shipped entry on the repeat")


if __name__ == "__main__":
    main()
