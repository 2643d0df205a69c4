"""Kernel-level profile of decode graph replays (dummy weights, full width): where a step's GPU time goes.

Prints the kernels of one replayed decode step: name, launches per step, mean us, total us per step, and the
number of kernels per step and per layer."""
import argparse, sys, torch
from mlaserve.bench.one_batch import build_runner, one_batch, model_dir

ap = argparse.ArgumentParser()
ap.add_argument("--model-config", default="mlaserve/tools/configs/deepseek-v2-lite.json")
ap.add_argument("--bs", type=int, default=1)
ap.add_argument("--replays", type=int, default=10)
a = ap.parse_args()
args = argparse.Namespace(model_path=None, model_config=a.model_config, load_format="dummy", batch_size=[a.bs],
                          input_len=256, output_len=8, dtype="auto", device="auto", attention_backend="auto",
                          disable_cuda_graph=False, enable_torch_compile=False,
                          speculative_algorithm=None, speculative_num_steps=None)
runner, pool, alloc = build_runner(args, model_dir(args))
one_batch(runner, pool, alloc, a.bs, 256, 4)
g = runner.graphs.graphs[min(b for b in runner.graphs.batch_sizes if b >= a.bs)]
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
total = sum(e.device_time_total for e in rows) / a.replays
launches = sum(e.count for e in rows) / a.replays
print(f"config {a.model_config} bs {a.bs}: {launches:.0f} kernels per step ({launches / n:.1f} per layer), "
      f"{total / 1000:.3f} ms of kernel time per step")
print(f"{'per step':>8} {'mean us':>8} {'us/step':>8}  kernel")
for e in rows:
    print(f"{e.count / a.replays:8.1f} {e.device_time_total / e.count:8.2f} {e.device_time_total / a.replays:8.1f}  "
          f"{e.key[:110]}")
