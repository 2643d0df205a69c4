"""Kernel-level profile of decode graph replays (V2-Lite dummy, full width): where a step's GPU time goes."""
import argparse, sys, torch
from mlaserve.bench.one_batch import build_runner, one_batch

ap = argparse.ArgumentParser()
ap.add_argument("--model-config", default="mlaserve/tools/configs/deepseek-v2-lite.json")
ap.add_argument("--bs", type=int, default=1)
a = ap.parse_args()
args = argparse.Namespace(model_path=None, model_config=a.model_config, load_format="dummy", batch_size=[a.bs],
                          input_len=256, output_len=8, dtype="auto", device="auto", attention_backend="auto",
                          disable_cuda_graph=False, enable_torch_compile=False)
from mlaserve.bench.one_batch import model_dir
runner, pool, alloc = build_runner(args, model_dir(args))
one_batch(runner, pool, alloc, a.bs, 256, 4)
g = runner.graphs.graphs[min(b for b in runner.graphs.batch_sizes if b >= a.bs)]
for _ in range(5):
    g.replay()
torch.cuda.synchronize()
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
    for _ in range(10):
        g.replay()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60))
