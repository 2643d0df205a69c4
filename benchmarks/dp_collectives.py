"""Issue 12's per-layer collectives: what DP attention's gather + scatter around an MoE costs against the two
all-reduces per layer that tensor parallelism runs on the same tokens. Ranks of `--tp-size` = `--dp-size` D (groups
of one rank, as `--tp-size 8 --dp-size 8`); each group has `bs` tokens, so TP serves the same D x bs tokens.

Per layer, [tokens, hidden] bf16, 10 layers back to back inside a CUDA graph, us per layer:
  tp 2 x all-reduce    two all-reduces of [D bs, h] (over the peer buffers where they take the rows, else NCCL)
  dp chosen            DPAttention.gather + scatter as the model runs them (reduce-scatter, or the peer all-reduce
                       where it takes the rows: `DPAttention.reduce_scatters`)
  dp + nccl all-reduce the gather, then an NCCL all-reduce of [D bs, h] (each rank keeping its rows)
  dp + reduce-scatter  the gather, then a reduce-scatter of [D bs, h]
The MoE between the gather and the scatter is not run: this is the collectives' share of a step.

    python benchmarks/dp_collectives.py --tp-size 2            # GPUs (NCCL, CUDA IPC)
    python benchmarks/dp_collectives.py --tp-size 2 --cpu      # gloo: the script's plumbing only
"""
from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

from mlaserve.bench.timing import time_graph_or_wall
from mlaserve.distributed import RankGroup, spawn_ranks
from mlaserve.distributed.expert import reduce_scatter_rows

BATCHES = [1, 16, 64, 128, 512, 2048]
LAYERS = 10


def time_layers(group: RankGroup, batches: list[int], hidden: int, layers: int) -> list[dict]:
    dp, world = group.dp, group.dp.world
    cuda = world.nccl
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    rows = []
    for bs in batches:
        d = dp.dp_size
        counts = [bs] * d
        x = torch.randn(bs, hidden, device=device).to(dtype)
        z = torch.zeros(d * bs, hidden, dtype=dtype, device=device)        # timed in place: stays finite
        ways = {
            "tp 2 x all-reduce": lambda: [world.all_reduce(z), world.all_reduce(z)],
            "dp chosen": lambda: dp.scatter(dp.gather(x, counts).mul_(0), counts),
            "dp + nccl all-reduce": lambda: dist.all_reduce(dp.gather(x, counts).mul_(0), group=world.group),
            "dp + reduce-scatter": lambda: reduce_scatter_rows(dp.gather(x, counts), world.size, world.group),
        }
        row = {"bs per group": bs, "tokens": d * bs, "bytes per rank": bs * hidden * x.element_size(),
               "dp path": "reduce-scatter" if dp.reduce_scatters(z) else "all-reduce",
               "tp peer": world.fuses_norm(z)}
        for name, fn in ways.items():
            row[name] = time_graph_or_wall(lambda: [fn() for _ in range(layers)], cuda) * 1e6 / layers
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tp-size", type=int, default=2, help="ranks = DP groups (groups of one rank)")
    ap.add_argument("--hidden", type=int, default=7168, help="hidden size (DeepSeek-V3: 7168)")
    ap.add_argument("--cpu", action="store_true")
    args = ap.parse_args()
    batches, hidden = (BATCHES, args.hidden) if not args.cpu else ([1, 8], 256)
    rows = spawn_ranks(time_layers, args.tp_size, batches, hidden, LAYERS, device="cpu" if args.cpu else "cuda",
                       dp_size=args.tp_size, peer_all_reduce=False if args.cpu else None)[0]
    name = "cpu (gloo)" if args.cpu else f"{torch.cuda.get_device_name()} x {args.tp_size}"
    print(f"### collectives per MoE layer, {name}, --tp-size {args.tp_size} --dp-size {args.tp_size}, hidden "
          f"{hidden}, {LAYERS} layers back to back{' in a CUDA graph' if not args.cpu else ''}, us per layer\n")
    ways = [k for k in rows[0] if k not in ("bs per group", "tokens", "bytes per rank", "dp path", "tp peer")]
    print("| bs per group | tokens | bytes per rank | " + " | ".join(ways) + " | dp path | tp over peer |")
    print("|---|---|---|" + "---|" * (len(ways) + 2))
    for r in rows:
        print(f"| {r['bs per group']} | {r['tokens']} | {r['bytes per rank']} | "
              + " | ".join(f"{r[k]:.1f}" for k in ways) + f" | {r['dp path']} | {r['tp peer']} |")


if __name__ == "__main__":
    main()
