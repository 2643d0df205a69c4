"""Kernel-level profile of decode graph replays (dummy weights, full width): where a step's GPU time goes.

Prints the kernels of one replayed decode step: name, launches per step, mean us, total us per step, and the
number of kernels per step and per layer."""
import argparse, torch
from mlaserve.bench.one_batch import build_parser, build_runner, model_dir, one_batch

ap = argparse.ArgumentParser()
ap.add_argument("--model-config", default="mlaserve/tools/configs/deepseek-v2-lite.json")
ap.add_argument("--bs", type=int, default=1)
ap.add_argument("--replays", type=int, default=10)
a = ap.parse_args()
args = build_parser().parse_args(["--load-format", "dummy", "--model-config", a.model_config, "--batch-size",
                                  str(a.bs), "--input-len", "256", "--output-len", "8"])
runner, pool, alloc = build_runner(args, model_dir(args))
one_batch(runner, pool, alloc, a.bs, 256, 4)
g = runner.graphs.graph_of(a.bs, 256 + 4 - 1)                 # the graph one_batch's last step replayed
for _ in range(5):
    g.replay()
torch.cuda.synchronize()
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    for _ in range(a.replays):
        g.replay()
    torch.cuda.synchronize()
rows = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA and e.count]
rows.sort(key=lambda e: -e.device_time_total)
n = runner.model.cfg.num_hidden_layers
# one replay alone, launched from an idle GPU and waited for (as a synchronous step sees it), against its GPU time
import time  # noqa: E402

walls, gpus = [], []
for _ in range(20):
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    g.replay()
    end.record()
    t1 = time.perf_counter()
    end.synchronize()
    walls.append((time.perf_counter() - t0, t1 - t0))
    gpus.append(start.elapsed_time(end) / 1e3)
walls.sort()
print(f"one replay from idle: wall {walls[10][0] * 1e3:.3f} ms (of it the launch call {walls[10][1] * 1e3:.3f} ms), "
      f"GPU (events) {sorted(gpus)[10] * 1e3:.3f} ms; medians of 20")
total = sum(e.device_time_total for e in rows) / a.replays
launches = sum(e.count for e in rows) / a.replays
print(f"config {a.model_config} bs {a.bs}: {launches:.0f} kernels per step ({launches / n:.1f} per layer), "
      f"{total / 1000:.3f} ms of kernel time per step")
print(f"{'per step':>8} {'mean us':>8} {'us/step':>8}  kernel")
for e in rows:
    print(f"{e.count / a.replays:8.1f} {e.device_time_total / e.count:8.2f} {e.device_time_total / a.replays:8.1f}  "
          f"{e.key[:110]}")

# One whole decode step as the one-batch bench times it (host work + replay + sampling): the host ops that run
# while the GPU waits, by self CPU time.
from mlaserve.core import Batch, ForwardMode, Req, SamplingParams  # noqa: E402

reqs = [Req(f"h{i}", torch.randint(2, runner.cfg.vocab_size, (32,)).tolist(),
            SamplingParams(max_new_tokens=4, temperature=0, ignore_eos=True), seed=i) for i in range(a.bs)]
slots = alloc.alloc(a.bs * 32)
for i, r in enumerate(reqs):
    r.req_pool_idx = pool.alloc()
    pool.write(r.req_pool_idx, 0, slots[i * 32:(i + 1) * 32])
    r.kv_len = 32
runner.forward(Batch(ForwardMode.EXTEND, reqs, [t for r in reqs for t in r.input_ids], slots, [0] * a.bs,
                     [32] * a.bs, [True] * a.bs))


def decode_step() -> None:
    s = alloc.alloc(a.bs)
    prefix = [r.kv_len for r in reqs]
    for r, slot in zip(reqs, s):
        pool.write(r.req_pool_idx, r.kv_len, slot.view(1))
        r.kv_len += 1
    runner.forward(Batch(ForwardMode.DECODE, reqs, [0] * a.bs, s, prefix, [1] * a.bs, [True] * a.bs))


for _ in range(3):
    decode_step()
torch.cuda.synchronize()
import time  # noqa: E402
t0 = time.perf_counter()
for _ in range(10):
    decode_step()
torch.cuda.synchronize()
print(f"\nwhole decode step (host + replay + sampling, synchronous): {(time.perf_counter() - t0) / 10 * 1e3:.3f} ms")
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                        torch.profiler.ProfilerActivity.CUDA]) as prof:
    decode_step()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=50))
