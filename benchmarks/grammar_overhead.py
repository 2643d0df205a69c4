"""Decode-step overhead of structured output (issue 16): the same batch decoded free and under a JSON schema,
through the real scheduler loop (overlap scheduler on, CUDA graphs as resolved), at several batch sizes.

Prints per batch size: mean / median step time free and constrained, the overhead (target <= 5 %), and the CPU
time spent filling bitmasks per step (hidden behind the forward when the overlap works).

    python benchmarks/grammar_overhead.py                                   # the built-in demo model
    python benchmarks/grammar_overhead.py --model-path DIR                  # a checkpoint with tokenizer.json
    python benchmarks/grammar_overhead.py --model-path V2LITE_CONFIG_DIR --load-format dummy \\
        --tokenizer-path DEMO_DIR                                           # V2-Lite shapes, random weights
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from mlaserve.config import ServerConfig
from mlaserve.core import SamplingParams
from mlaserve.ipc.messages import GenerateReqMsg
from mlaserve.scheduler.scheduler import Scheduler

# never complete within the bench's budget: the grammar stays active (strings, numbers, punctuation) every step
SCHEMA = {"type": "array", "minItems": 10000, "items": {"type": "object", "required": ["name", "n"], "properties": {
    "name": {"type": "string"}, "n": {"type": "integer"}}}}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def make_sched(args: argparse.Namespace, path: str) -> Scheduler:
    flags = dict(model_path=path, load_format=args.load_format, device=args.device, log_level="warning",
                 max_running_requests=max(args.batch_size), tokenizer_path=args.tokenizer_path)
    if args.device == "cpu":
        flags["max_total_tokens"] = max(args.batch_size) * (args.input_len + args.steps + args.warmup + 16)
    return Scheduler(ServerConfig.from_flat(**flags), path)


def requests(bs: int, args: argparse.Namespace, constrained: bool, tag: str) -> list[GenerateReqMsg]:
    extra = {"json_schema": json.dumps(SCHEMA)} if constrained else {"ignore_eos": True}
    params = SamplingParams(max_new_tokens=args.warmup + args.steps + 8, temperature=1.0, **extra)
    gen = torch.Generator().manual_seed(bs)
    return [GenerateReqMsg(f"{tag}{i}", torch.randint(20, 4000, (args.input_len,), generator=gen).tolist(), params,
                           seed=i) for i in range(bs)]


def run_case(sched: Scheduler, reqs: list[GenerateReqMsg], args: argparse.Namespace) -> tuple[list[float], list[float]]:
    """(wall seconds per decode step, CPU seconds filling bitmasks per step) over `args.steps` steps."""
    fill: list[float] = []
    inner = sched.grammar.bitmask

    def timed(batch):
        t = time.perf_counter()
        out = inner(batch)
        if out is not None:
            fill.append(time.perf_counter() - t)
        return out

    sched.grammar.bitmask = timed
    for r in reqs:
        sched.add_request(r)
    while sched.waiting or sched.grammar.waiting or sched.chunked or len(sched.running) < len(reqs):
        sched.step()
    for _ in range(args.warmup):
        sched.step()
    sync()
    fill.clear()
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        sched.step()
        times.append(time.perf_counter() - t)
    sync()
    for r in reqs:
        sched.abort(r.rid)
    while sched.has_work:
        sched.step()
    sched.grammar.bitmask = inner
    return times, fill


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-path", default=None, help="checkpoint (default: the built-in demo model)")
    ap.add_argument("--tokenizer-path", default=None, help="tokenizer.json directory (default: --model-path)")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch-size", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    args = ap.parse_args()
    path = args.model_path
    if path is None:
        from mlaserve.server.launch import demo_model_path

        path = str(demo_model_path())
    sched = make_sched(args, path)
    print(f"model {path}, device {sched.runner.device}, overlap {sched.overlap}, "
          f"cuda graphs {not sched.server.sched.disable_cuda_graph}, vocab {sched.runner.cfg.vocab_size}")
    print("| bs | free step ms (mean / p50) | constrained step ms (mean / p50) | overhead | bitmask fill ms/step |")
    print("|---|---|---|---|---|")
    for bs in args.batch_size:
        for constrained in (False, True):     # untimed: first-use costs (allocations, lazy inits) stay out
            run_case(sched, requests(bs, args, constrained, "w"), argparse.Namespace(**{**vars(args), "steps": 2}))
        free, _ = run_case(sched, requests(bs, args, False, "f"), args)
        cons, fill = run_case(sched, requests(bs, args, True, "c"), args)
        fm, cm = statistics.mean(free), statistics.mean(cons)
        print(f"| {bs} | {fm * 1e3:.3f} / {statistics.median(free) * 1e3:.3f} | {cm * 1e3:.3f} / "
              f"{statistics.median(cons) * 1e3:.3f} | {100 * (cm / fm - 1):+.1f} % | "
              f"{statistics.mean(fill) * 1e3 if fill else float('nan'):.3f} |")


if __name__ == "__main__":
    main()
