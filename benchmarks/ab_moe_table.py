"""One prompt's prefill with the shipped fused-MoE tables and with entries swapped in, alternated in one process (GPU).

The entries come from `PICK tokens config table-file` lines (benchmarks/sweep_moe_prefill.py); each replaces
that token count's entry of a copy of the shipped tables. Per round and table set: the median GPU time (CUDA events
around the forward, eager, dummy weights) of `--repeats` prefills after two warm-ups, and whether the greedy token
equals the shipped tables' one.

Usage: PYTHONPATH=$PWD python3 benchmarks/ab_moe_table.py --picks FILE [--model-config CFG] [--len 4096]
"""
import argparse
import json
import shutil
import statistics
import tempfile
from pathlib import Path

import torch

from mlaserve.bench.one_batch import eager_prefill
from mlaserve.kernels import fused_moe as fm


def picked_tables(picks: str) -> Path:
    out = Path(tempfile.mkdtemp(prefix="moe-tables-"))
    for f in fm.CONFIG_DIR.glob("*.json"):
        shutil.copy(f, out / f.name)
    for line in Path(picks).read_text().splitlines():
        if not line.startswith("PICK "):
            continue
        _, tokens, rest = line.split(" ", 2)
        cfg_text, name = rest.rsplit("} ", 1)
        path = out / name
        table = json.loads(path.read_text()) if path.is_file() else {}
        table[tokens] = json.loads(cfg_text + "}")
        path.write_text(json.dumps(table, indent=1))
        print(f"picked {name} [{tokens}] = {table[tokens]}")
    return out


def timed(runner, batch, repeats: int) -> tuple[float, int]:
    for _ in range(2):
        runner.resolve(runner.launch_sample(runner.launch_forward(batch)))
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = runner.resolve(runner.launch_sample(runner.launch_forward(batch)))
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), out.next_ids[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--picks", required=True)
    ap.add_argument("--model-config", default="mlaserve/tools/configs/deepseek-v2-lite.json")
    ap.add_argument("--len", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=10)
    a = ap.parse_args()
    shipped, picked = fm.CONFIG_DIR, picked_tables(a.picks)
    runner, batch = eager_prefill(a.model_config, a.len)
    name = a.model_config.split("/")[-1]
    first = None
    for r in range(a.rounds):
        for tag, tables in (("shipped", shipped), ("picked", picked)):
            fm.CONFIG_DIR = tables
            ms, tok = timed(runner, batch, a.repeats)
            first = tok if first is None else first
            print(f"round {r} {tag:8s} {name} 1 x {a.len}: GPU {ms:7.2f} ms (median of {a.repeats}), "
                  f"greedy token {'same' if tok == first else f'differs ({tok} vs {first})'}", flush=True)


if __name__ == "__main__":
    main()
