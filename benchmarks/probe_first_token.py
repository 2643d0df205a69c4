"""Where a lone request's time to first token goes inside the scheduler (issue 15: TTFT at concurrency 1 against the
prefill time): the real scheduler in-process over a dummy-weight checkpoint, one request at a time; each `step()`
call's wall time until the step that returns the request's first token, and the request's total.

    PYTHONPATH=$PWD python benchmarks/probe_first_token.py --model-path DIR [--piecewise] [--len 200] \
        [--shared-first] [--profile]

--shared-first starts every prompt with token 1 (after the first request, a one-token radix hit, as BOS-led text
prompts); --profile prints the torch profiler's table (host and GPU time per op) of the last request's steps.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from mlaserve.config import ServerConfig
from mlaserve.core import SamplingParams
from mlaserve.ipc.messages import GenerateReqMsg
from mlaserve.scheduler.scheduler import Scheduler


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--piecewise", action="store_true")
    ap.add_argument("--len", type=int, default=200)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--shared-first", action="store_true")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    sched = Scheduler(ServerConfig.from_flat(model_path=args.model_path, load_format="dummy", log_level="warning",
                                             enable_piecewise_cuda_graph=args.piecewise), args.model_path)
    rng = random.Random(0)
    vocab = sched.runner.cfg.vocab_size
    totals = []
    for k in range(args.requests):
        ids = [rng.randrange(10, vocab) for _ in range(args.len)]
        if args.shared_first:
            ids[0] = 1
        prof = None
        if args.profile and k == args.requests - 1:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                      torch.profiler.ProfilerActivity.CUDA])
            prof.__enter__()
        sched.add_request(GenerateReqMsg(f"r{k}", ids, SamplingParams(max_new_tokens=4, temperature=0.0,
                                                                      ignore_eos=True), seed=1))
        t, steps = time.perf_counter(), []
        while True:
            t1 = time.perf_counter()
            outs = sched.step()
            steps.append(round((time.perf_counter() - t1) * 1e3, 2))
            if any(o.new_ids for o in outs):
                break
        totals.append((time.perf_counter() - t) * 1e3)
        if prof is not None:
            torch.cuda.synchronize()
            prof.__exit__(None, None, None)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
        while sched.has_work:
            sched.step()
        torch.cuda.synchronize()
        print(f"request {k}: steps until its first token (ms) {steps}, total {totals[-1]:.2f} ms")
    print(f"median time to first token in the scheduler: {statistics.median(totals[2:]):.2f} ms")


if __name__ == "__main__":
    main()
