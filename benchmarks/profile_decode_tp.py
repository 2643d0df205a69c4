"""Kernel-level profile of one decode graph replay at tensor parallelism (dummy weights): where a tp rank's step goes.

Every rank builds its runner, warms up with one batch, then replays its captured decode graph in lockstep with the
others (the graph holds the collectives); rank 0 replays under the torch profiler and prints the kernels of one
step: launches per step, mean us, us per step. Then each rank times one prefill of `--input-len` tokens, synced over
the ranks, then under the profiler, and rank 0 prints one prefill's kernel time beside its wall time (the GPU idle
between kernels is host launch time), and every rank its prefill's top host ops. `--tp-size 1` runs the single
process the same way, for comparison; `--piecewise` builds the runner with the piecewise prefill graphs; CPROFILE=1
also prints every rank's prefill under cProfile (the Python side of an eager prefill).

    python3 benchmarks/profile_decode_tp.py --tp-size 2 --bs 1
"""
import argparse
import contextlib
import os
import statistics

import torch

from mlaserve.bench.one_batch import PREFILL_REPEATS, build_parser, build_runner, model_dir, one_batch, sync
from mlaserve.distributed.parallel import spawn_ranks


def cuda_profile(rank: int):
    """The CUDA-kernel profiler on rank 0; nothing on the others (they run the same collectives unprofiled)."""
    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) if rank == 0 \
        else contextlib.nullcontext()


def kernel_rows(prof, steps: int) -> tuple[list, float, float]:
    rows = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA and e.count
            and not e.key.startswith(("Memset", "Memcpy"))]
    rows.sort(key=lambda e: -e.device_time_total)
    return rows, sum(e.device_time_total for e in rows) / steps, sum(e.count for e in rows) / steps


def print_rows(rows: list, steps: int, limit: int = 30) -> None:
    print(f"{'per step':>8} {'mean us':>8} {'us/step':>8}  kernel")
    for e in rows[:limit]:
        print(f"{e.count / steps:8.1f} {e.device_time_total / e.count:8.2f} {e.device_time_total / steps:8.1f}  {e.key[:100]}")


def rank_main(group, args, path: str, bs: int, replays: int, input_len: int) -> None:
    rank = group.info.rank if group else 0
    device = f"cuda:{rank}" if group else None
    torch.manual_seed(0)                                   # the same prompts on every rank
    runner, pool, alloc = build_runner(args, path, group, device)
    one_batch(runner, pool, alloc, bs, input_len, 4)
    g = runner.graphs.graph_of(bs, input_len + 4 - 1)          # the graph one_batch's last step replayed
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    sync(group)
    # one replay at a time, synced over the ranks: the GPU time a synchronous step sees
    gpus = []
    for _ in range(20):
        sync(group)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        gpus.append(start.elapsed_time(end))
    sync(group)
    with cuda_profile(rank) as prof:
        for _ in range(replays):
            g.replay()
        torch.cuda.synchronize()
    sync(group)
    n = runner.model.cfg.num_hidden_layers
    if rank == 0:
        rows, total, launches = kernel_rows(prof, replays)
        tp = group.size if group else 1
        print(f"== decode, tp {tp}, bs {bs}: one replay {statistics.median(gpus):.3f} ms (GPU events, median of 20); "
              f"{launches:.0f} kernels per step ({launches / n:.1f} per layer), {total / 1000:.3f} ms of kernel time")
        print_rows(rows, replays)
    # prefill of one prompt: wall time (synced), then its kernels under the profiler
    wall = one_batch(runner, pool, alloc, 1, input_len, 2, graph_stats=False)["prefill_s"]
    sync(group)
    with cuda_profile(rank) as prof:
        one_batch(runner, pool, alloc, 1, input_len, 1, graph_stats=False)
        torch.cuda.synchronize()
    sync(group)
    if rank == 0:
        rows, total, launches = kernel_rows(prof, 1 + PREFILL_REPEATS)        # one-batch runs the prefill 1 + 3 times
        print(f"== prefill 1 x {input_len}, tp {group.size if group else 1}: wall "
              f"{wall * 1e3:.1f} ms (one-batch's median), {launches:.0f} kernels, "
              f"{total / 1000:.2f} ms of kernel time")
        print_rows(rows, 1 + PREFILL_REPEATS, 20)
    # the host side of one prefill on every rank (the eager prefill is host-bound): its top CPU ops
    sync(group)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as cpu:
        one_batch(runner, pool, alloc, 1, input_len, 1, graph_stats=False)
        torch.cuda.synchronize()
    sync(group)
    if os.environ.get("CPROFILE"):       # the Python side too: one prefill under cProfile, top functions by own time
        import cProfile, io, pstats
        pr = cProfile.Profile()
        sync(group)
        pr.enable()
        one_batch(runner, pool, alloc, 1, input_len, 1, graph_stats=False)
        torch.cuda.synchronize()
        pr.disable()
        sync(group)
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(25)
        print(f"== cProfile, rank {rank}, {1 + PREFILL_REPEATS} prefills of 1 x {input_len}\n"
              + "\n".join(f"  rank {rank} {line}" for line in buf.getvalue().splitlines() if line.strip()), flush=True)
    ops = sorted(cpu.key_averages(), key=lambda e: -e.self_cpu_time_total)[:14]
    total = sum(e.self_cpu_time_total for e in cpu.key_averages()) / (1 + PREFILL_REPEATS) / 1e3
    print(f"== host, rank {rank}, one prefill 1 x {input_len}: {total:.1f} ms of self CPU time (under the profiler)\n"
          + "\n".join(f"  rank {rank} {e.count / (1 + PREFILL_REPEATS):7.1f} calls {e.self_cpu_time_total / 1e3 / (1 + PREFILL_REPEATS):7.2f} ms  {e.key[:70]}"
                      for e in ops), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-config", default="mlaserve/tools/configs/deepseek-v2-lite.json")
    ap.add_argument("--tp-size", type=int, default=2)
    ap.add_argument("--bs", type=int, default=1)
    ap.add_argument("--replays", type=int, default=10)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--piecewise", action="store_true", help="with --enable-piecewise-cuda-graph")
    a = ap.parse_args()
    args = build_parser().parse_args(["--load-format", "dummy", "--model-config", a.model_config, "--batch-size",
                                      str(a.bs), "--input-len", str(a.input_len), "--output-len", "8"]
                                     + ["--enable-piecewise-cuda-graph"] * a.piecewise)
    args.ep = 1
    path = model_dir(args)
    if a.tp_size == 1:
        rank_main(None, args, path, a.bs, a.replays, a.input_len)
    else:
        spawn_ranks(rank_main, a.tp_size, args, path, a.bs, a.replays, a.input_len, device="cuda")


if __name__ == "__main__":
    main()
