"""How long each scheduler step takes when new prompts arrive while many requests decode, with and without
--enable-mixed-chunk (issue 15: p99 inter-token latency at concurrency 64). GPU, in-process, overlap off so each
`Scheduler.step` is one batch launched and processed.

The real scheduler over a dummy-weight checkpoint: RUNNING requests of PROMPT tokens decode, then ARRIVE new
prompts of the same length come in; every step's wall time (synchronised) is printed with its batch: mode, new
tokens, decodes riding along (`E576+64:67.4` = an extend of 576 tokens, 64 of them decodes, 67.4 ms). Several
waves show what repeats once the shapes were seen. With --profile, the first step of the last wave runs under the
torch profiler and its top operators by host time are printed; with --cprofile, the extend steps of the last
wave run under cProfile (Python functions by cumulative and own time).

    PYTHONPATH=$PWD python benchmarks/probe_mixed_step.py --model-path DIR [--mixed] [--piecewise] [--chunk N] [--profile]
"""
from __future__ import annotations

import argparse
import json
import random
import time

import torch

from mlaserve.config import ServerConfig
from mlaserve.core import ForwardMode, SamplingParams
from mlaserve.ipc.messages import GenerateReqMsg
from mlaserve.scheduler.scheduler import Scheduler


def compiled_kernels() -> dict[str, int]:
    """Compiled variants of each of our Triton kernels so far (a step that compiles one shows it)."""
    import importlib
    import pkgutil

    import mlaserve.kernels
    from triton.runtime.jit import JITFunction

    counts = {}
    for mod in pkgutil.iter_modules(mlaserve.kernels.__path__):
        for name, fn in vars(importlib.import_module(f"mlaserve.kernels.{mod.name}")).items():
            if isinstance(fn, JITFunction):
                counts[name] = sum(len(c[0]) for c in fn.device_caches.values())
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--mixed", action="store_true")
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--piecewise", action="store_true", help="--enable-piecewise-cuda-graph")
    ap.add_argument("--running", type=int, default=64)
    ap.add_argument("--arrive", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--waves", type=int, default=3, help="arrival waves, 8 steps each")
    ap.add_argument("--profile", action="store_true", help="profile the first step of the last wave")
    ap.add_argument("--cprofile", action="store_true", help="cProfile the extend steps of the last wave (Python time)")
    args = ap.parse_args()
    sched = Scheduler(ServerConfig.from_flat(
        model_path=args.model_path, load_format="dummy", log_level="warning", disable_overlap_schedule=True,
        enable_mixed_chunk=args.mixed, chunked_prefill_size=args.chunk,
        enable_piecewise_cuda_graph=args.piecewise), args.model_path)
    rng = random.Random(0)
    vocab = sched.runner.cfg.vocab_size
    batches: list[tuple[str, int, int]] = []
    launch = sched.runner.launch

    def traced(batch, *a, **kw):
        batches.append((batch.mode.name, sum(batch.extend_lens) if batch.mode is ForwardMode.EXTEND
                        else len(batch.reqs), batch.num_decode))
        return launch(batch, *a, **kw)
    sched.runner.launch = traced

    def add(rid: str) -> None:
        ids = [rng.randrange(10, vocab) for _ in range(args.prompt)]
        sched.add_request(GenerateReqMsg(rid, ids, SamplingParams(max_new_tokens=400, temperature=0.0,
                                                                  ignore_eos=True), seed=1))

    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    compiled = compiled_kernels()

    def step() -> tuple[float, tuple]:
        n = len(batches)
        sync()
        t = time.perf_counter()
        sched.step()
        sync()
        return (time.perf_counter() - t) * 1e3, batches[n] if len(batches) > n else ("none", 0, 0)

    for i in range(args.running):
        add(f"r{i}")
    while sched.waiting or sched.chunked:
        step()
    for _ in range(10):
        step()
    decode_ms = sorted(step()[0] for _ in range(10))[5]
    waves, prof_py = [], None
    for wave in range(args.waves):
        for i in range(args.arrive):
            add(f"a{wave}.{i}")
        rows = []
        while len(rows) < 8:
            if args.profile and wave == args.waves - 1 and not rows:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                        torch.profiler.ProfilerActivity.CUDA]) as prof:
                    ms, b = step()
                avg = prof.key_averages()
                print(avg.table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=60))
                print(avg.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=60))
            elif args.cprofile and wave == args.waves - 1 and (sched.waiting or sched.chunked):
                import cProfile
                prof_py = prof_py or cProfile.Profile()
                prof_py.enable()
                ms, b = step()
                prof_py.disable()
            else:
                ms, b = step()
            now = compiled_kernels()
            new = sorted({name for name, n in now.items() if n > compiled.get(name, 0)})
            compiled.update(now)
            rows.append(f"{b[0][0]}{b[1]}+{b[2]}:{ms:.1f}" + (f"[compiled {','.join(new)}]" if new else ""))
        waves.append(" ".join(rows))
    if prof_py is not None:
        import pstats
        for key in ("cumulative", "tottime"):
            pstats.Stats(prof_py).sort_stats(key).print_stats(28)
    print(json.dumps({"mixed": args.mixed, "piecewise": args.piecewise, "chunk": args.chunk, "running": args.running, "arrive": args.arrive,
                      "prompt": args.prompt, "decode_step_ms": round(decode_ms, 2), "waves": waves}))


if __name__ == "__main__":
    main()
