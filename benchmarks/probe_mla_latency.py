"""mla_decode latency, the split merge folded into the decode kernel or not, side by side.

Contiguous slots. Unfolded: the merge as a second launch; folded: in the decode kernel (a `sync` buffer, and
FOLD_MAX_VALUES lifted so it folds at every split count). Per case: the kernel times from the profiler and the
per-call time of 20 calls replayed back to back in one CUDA graph; `rule` is what `fold_reduce` picks there, `diff`
the max |folded - unfolded| output. The split count is chosen as the engine does, from the batch and a context
limit: `ctx` (the batch's own context: eager decode) or a number (a server's context limit: decode graphs, whose
split count is fixed at capture).
Usage: PYTHONPATH=$PWD python3 benchmarks/probe_mla_latency.py [--heads 16 128] [--batch 1 16]
[--ctx 256 2048 16384] [--limit ctx 163840] [--splits S]
"""
from __future__ import annotations

import argparse
from typing import Callable

import torch

import mlaserve.kernels.mla_decode as md
from mlaserve.bench.kernel_cases.mla_decode import KV_LORA_RANK, make_inputs

CALLS = 20              # calls per graph replay


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--ctx", type=int, nargs="+", default=[256, 2048, 16384])
    ap.add_argument("--limit", nargs="+", default=["ctx", "163840"],
                    help="context limits the split count is chosen from: ctx (the batch's own) or a number")
    ap.add_argument("--splits", type=int, default=None, help="this split count instead of the engine's choice")
    args = ap.parse_args(argv)
    for lim in args.limit:
        if lim != "ctx" and not lim.isdigit():
            ap.error(f"--limit takes ctx or a number of tokens, got {lim!r}")
    return args


def time_graph(fn: Callable[[], object]) -> tuple[dict[str, float], float]:
    """(us per launch of each mla_decode kernel, us per call) of CALLS calls of `fn` replayed in one graph."""
    for _ in range(3):
        fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    kernels = {e.key: e.device_time_total / e.count for e in prof.key_averages() if e.count and "mla_decode" in e.key}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    return kernels, start.elapsed_time(end) * 1e3 / CALLS


def one_case(heads: int, batch: int, ctx: int, limit: str, splits: int | None) -> str:
    inp = make_inputs(heads, batch, ctx)
    inp["req_to_token"] = torch.arange(batch * ctx, device="cuda", dtype=torch.int32).view(batch, ctx)
    programs = md.decode_programs(batch, heads)
    s = splits or md.choose_num_kv_splits(programs, ctx if limit == "ctx" else int(limit))
    rows = min(md.pick_config(heads).block_h, heads)
    rule = "fold" if md.fold_reduce(s, rows, KV_LORA_RANK) else "reduce"
    out = torch.empty(batch, heads, KV_LORA_RANK, device="cuda", dtype=torch.bfloat16)
    two, two_us = time_graph(lambda: md.mla_decode(**inp, num_kv_splits=s, out=out))
    sync = torch.zeros(max(md.SYNC_ENTRIES, programs), dtype=torch.int32, device="cuda")
    folded = torch.empty_like(out)
    saved, md.FOLD_MAX_VALUES = md.FOLD_MAX_VALUES, 1 << 62
    try:
        one, one_us = time_graph(lambda: md.mla_decode(**inp, num_kv_splits=s, out=folded, sync=sync))
    finally:
        md.FOLD_MAX_VALUES = saved
    diff = (folded.float() - out.float()).abs().max().item()
    assert not sync.any(), "the folded merge left a nonzero arrival count"

    def kernels(ks: dict[str, float]) -> str:
        return " + ".join(f"{v:6.2f}" for v in ks.values())
    return (f"H={heads:3d} B={batch:2d} ctx={ctx:5d} limit={limit:>6} S={s:3d} rule={rule:6} | unfolded "
            f"{kernels(two)} us, {two_us:6.2f} us/call | folded {kernels(one)} us, {one_us:6.2f} us/call "
            f"| {one_us - two_us:+6.2f} us | diff {diff:.1e}")


def main() -> None:
    args = parse_args()
    print(f"mla_decode on {torch.cuda.get_device_name()}, bf16; kernel times: stage 1 (+ reduce) per launch; "
          f"{CALLS} calls back to back per replay; FOLD_MAX_VALUES {md.FOLD_MAX_VALUES}", flush=True)
    for heads in args.heads:
        for batch in args.batch:
            for ctx in args.ctx:
                for limit in args.limit:
                    print(one_case(heads, batch, ctx, limit, args.splits), flush=True)
                torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
