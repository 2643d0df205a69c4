"""Kernel-level profile of one prefill (dummy weights, full width): where a long prompt's GPU time goes.

Prints the kernels of one warm prefill of `--len` tokens (batch 1): launches, mean us, total us; the GPU's idle gaps;
with --cprofile, the host's Python functions over 5 more prefills (own and cumulative time)."""
import argparse

import torch

from mlaserve.bench.one_batch import eager_prefill

ap = argparse.ArgumentParser()
ap.add_argument("--model-config", default="mlaserve/tools/configs/deepseek-v2-lite.json")
ap.add_argument("--len", type=int, default=4096)
ap.add_argument("--cprofile", action="store_true")
ap.add_argument("--timeline", type=float, default=0.0, metavar="MS",
                help="the host's ops (with the frames of ours that made them) and the GPU's kernels of the first MS ms "
                "of the profiled prefill, in time order (the profiler then records stacks: its host times are inflated)")
ap.add_argument("--syncs", action="store_true", help="the host's CUDA API calls over 20 us (syncs, copies, "
                "allocations) with the Python frames that made them")
cli = ap.parse_args()
a = cli
runner, batch = eager_prefill(a.model_config, a.len)
for _ in range(2):
    runner.forward(batch)
torch.cuda.synchronize()
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
start.record()
runner.forward(batch)
end.record()
end.synchronize()
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
                            with_stack=a.syncs or bool(a.timeline)) as prof:
    runner.forward(batch)
    torch.cuda.synchronize()
rows = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA and e.count]
rows.sort(key=lambda e: -e.device_time_total)
total = sum(e.device_time_total for e in rows)
print(f"config {a.model_config} prefill 1 x {a.len}: {start.elapsed_time(end):.2f} ms wall, "
      f"{total / 1000:.2f} ms kernel time, {sum(e.count for e in rows)} kernels")
print(f"{'count':>6} {'mean us':>9} {'total us':>9}  kernel")
for e in rows[:30]:
    print(f"{e.count:6d} {e.device_time_total / e.count:9.1f} {e.device_time_total:9.1f}  {e.key[:100]}")

# GPU idle time: gaps between consecutive kernels, the largest with the kernels around them and the host op that
# was running (the CPU event spanning the gap's end: what the GPU waited for)
kern = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
              key=lambda e: e.time_range.start)
cpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
gaps = [(b.time_range.start - a.time_range.end, a, b) for a, b in zip(kern, kern[1:])]
print(f"GPU idle between kernels: {sum(g for g, _, _ in gaps if g > 0) / 1000:.2f} ms over {len(gaps)} gaps")
for g, a, b in sorted(gaps, key=lambda x: -x[0])[:12]:
    mid = (a.time_range.end + b.time_range.start) / 2
    host = sorted((c for c in cpu if c.time_range.start <= mid <= c.time_range.end),
                  key=lambda c: c.time_range.end - c.time_range.start)
    print(f"  {g:8.1f} us after {a.name[:40]!r} before {b.name[:40]!r}; host in: {[c.name[:40] for c in host[:4]]}")

if cli.timeline:
    # what the host did before the GPU had work: top-level host ops (not nested in another) and kernels by start
    t0 = min(e.time_range.start for e in prof.events())
    end = t0 + cli.timeline * 1000
    host = sorted((c for c in cpu if c.time_range.start < end), key=lambda c: c.time_range.start)
    top, last_end = [], -1.0
    for c in host:
        if c.time_range.start >= last_end:
            top.append(c)
            last_end = c.time_range.end
    def where(c) -> str:                 # the innermost frames of ours that made the op (with_stack)
        frames = [f.rsplit("/", 1)[-1] for f in (c.stack or []) if "mlaserve" in f]
        return " <- ".join(frames[:2])
    rows = [(c.time_range.start, "host", f"{c.name}  {where(c)}", c.time_range.end - c.time_range.start) for c in top]
    rows += [(k.time_range.start, "GPU ", k.name, k.time_range.end - k.time_range.start) for k in kern
             if k.time_range.start < end]
    print(f"--- timeline of the first {cli.timeline} ms (us from the first event; top-level host ops)")
    for t, side, name, dur in sorted(rows, key=lambda r: r[0]):
        print(f"  {(t - t0):8.1f} {side} {dur:8.1f} us  {name[:160]}")

if cli.cprofile:
    import cProfile
    import pstats

    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(5):
        runner.forward(batch)
    torch.cuda.synchronize()
    prof.disable()
    for key in ("tottime", "cumulative"):
        print(f"--- host, 5 prefills, by {key}")
        pstats.Stats(prof).sort_stats(key).print_stats(28)

if cli.syncs:
    api = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU and e.name.startswith("cuda")
           and e.time_range.end - e.time_range.start > 20]
    busy = sum(e.time_range.end - e.time_range.start for e in api)
    print(f"host CUDA API calls over 20 us: {len(api)}, {busy:.0f} us")
    t0 = min(e.time_range.start for e in prof.events())
    for e in sorted(api, key=lambda e: e.time_range.start)[:40]:
        frames = [f for f in (e.stack or []) if "mlaserve" in f or "benchmarks" in f][:3]
        print(f"  at {(e.time_range.start - t0) / 1000:7.2f} ms {e.name[:28]:28s} "
              f"{e.time_range.end - e.time_range.start:7.0f} us  {' <- '.join(frames)[:240]}")
