"""mla_decode latency at batch 1 (contiguous slots): stage-1 and reduce kernel times from the profiler, and the
per-call time of 20 calls replayed back to back in one CUDA graph. Usage: PYTHONPATH=$PWD python3 benchmarks/probe_mla_latency.py"""
import torch, mlaserve.kernels.mla_decode as md
from mlaserve.bench.kernel_cases.mla_decode import make_inputs
for heads in (16, 128):
    for ctx in (16, 64, 256, 1024, 4096):
        for splits in (1, 4, 16):
            inp = make_inputs(heads, 1, ctx)
            # contiguous slots (a real request's cache is mostly in order)
            inp["req_to_token"] = torch.arange(ctx, device="cuda", dtype=torch.int32).view(1, ctx)
            out = torch.empty(1, heads, 512, device="cuda", dtype=torch.bfloat16)
            for _ in range(3):
                md.mla_decode(**inp, num_kv_splits=splits, out=out)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(20):
                    md.mla_decode(**inp, num_kv_splits=splits, out=out)
            g.replay(); torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                g.replay(); torch.cuda.synchronize()
            ks = {e.key[:22]: e.device_time_total / e.count for e in prof.key_averages() if e.count}
            s = torch.cuda.Event(enable_timing=True); e = torch.cuda.Event(enable_timing=True)
            s.record(); g.replay(); e.record(); e.synchronize()
            print(f"H={heads} ctx={ctx:5d} splits={splits:2d}: " + ", ".join(f"{k} {v:.2f} us" for k, v in ks.items())
                  + f"; 20 calls back to back {s.elapsed_time(e) * 1e3 / 20:.2f} us/call", flush=True)
