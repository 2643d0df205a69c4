"""Closed-loop serving load on the real scheduler, in process (issue 15: TPOT and p99 inter-token latency at
concurrency 64): where the long inter-token gaps come from.

The load is `bench serving`'s random dataset at a fixed concurrency: NUM prompts of uniform length in
[INPUT * (1 - RATIO), INPUT], each asking for uniform [OUTPUT * (1 - RATIO), OUTPUT] new tokens (ignore_eos), CONC in
flight; when one finishes the next is added before the next step. The scheduler runs as the server runs it
(overlap on unless --no-overlap); each `Scheduler.step` is timed (wall, no extra syncs), and every output token is
stamped when the step that returns it returns. Prints the latency summary (TTFT, TPOT, ITL median / p99 as bench
serving computes them) and what the long gaps were: for the ITLs above 2x the median, the steps they spanned
(`E<extend tokens>+<decodes riding>` or `D<decodes>`, with their ms).

    PYTHONPATH=$PWD python benchmarks/probe_closed_loop.py --model-path DIR [--mixed] [--piecewise] [--chunk N]
"""
from __future__ import annotations

import argparse
import collections
import json
import random
import statistics
import time


from mlaserve.config import ServerConfig
from mlaserve.core import ForwardMode, SamplingParams
from mlaserve.ipc.messages import GenerateReqMsg
from mlaserve.scheduler.scheduler import Scheduler


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", required=True)
    ap.add_argument("--mixed", action="store_true", help="--enable-mixed-chunk")
    ap.add_argument("--piecewise", action="store_true", help="--enable-piecewise-cuda-graph")
    ap.add_argument("--chunk", type=int, default=None, help="--chunked-prefill-size (default: the server's)")
    ap.add_argument("--no-overlap", action="store_true")
    ap.add_argument("--num", type=int, default=192)
    ap.add_argument("--conc", type=int, default=64)
    ap.add_argument("--input", type=int, default=256)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--ratio", type=float, default=0.5)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--show", type=int, default=12, help="long gaps to print")
    ap.add_argument("--passes", type=int, default=1, help="run the same prompts again (radix cache hits)")
    ap.add_argument("--extra", default="{}", help="more ServerConfig fields, as JSON")
    args = ap.parse_args()
    flat = dict(model_path=args.model_path, load_format="dummy", log_level="warning",
                disable_overlap_schedule=args.no_overlap, enable_mixed_chunk=args.mixed,
                enable_piecewise_cuda_graph=args.piecewise) | json.loads(args.extra)
    if args.chunk is not None:
        flat["chunked_prefill_size"] = args.chunk
    sched = Scheduler(ServerConfig.from_flat(**flat), args.model_path)
    vocab = sched.runner.cfg.vocab_size
    print(f"seed {args.seed}", flush=True)

    steps: list[tuple[str, float]] = []                # (batch label, ms) of every launched step, in order
    launch = sched.runner.launch

    def traced(batch, *a, **kw):
        if batch.mode is ForwardMode.EXTEND:
            label = f"E{sum(batch.extend_lens)}+{batch.num_decode}"
        else:
            label = f"{batch.mode.name[0]}{len(batch.reqs)}"
        steps.append((label, 0.0))
        return launch(batch, *a, **kw)
    sched.runner.launch = traced

    def load(seed: int, n: int) -> list[tuple[list[int], int]]:
        """n requests: (prompt ids, new tokens), as bench serving's random dataset draws them."""
        rng = random.Random(seed)

        def length(m: int) -> int:
            return rng.randint(max(1, int(m * (1 - args.ratio))), m)
        return [([rng.randrange(10, vocab) for _ in range(length(args.input))], length(args.output))
                for _ in range(n)]

    def run_pass(tag: str, reqs: list[tuple[list[int], int]], report: bool) -> None:
        steps.clear()
        sent: dict[str, float] = {}

        def add(i: int) -> None:
            ids, new = reqs[i]
            sched.add_request(GenerateReqMsg(f"{tag}{i}", ids, SamplingParams(max_new_tokens=new, temperature=0.0,
                                                                               ignore_eos=True), seed=i))
            sent[f"{tag}{i}"] = time.perf_counter()

        stamps: dict[str, list[float]] = collections.defaultdict(list)   # rid -> time of each output token
        step_at: list[float] = []                                           # when each step() returned
        step_launched: list[int] = []                                       # steps launched by then
        nxt, done, num = 0, 0, len(reqs)
        while nxt < min(args.conc, num):
            add(nxt)
            nxt += 1
        t_start = time.perf_counter()
        while done < num:
            before = len(steps)
            t0 = time.perf_counter()
            out = sched.step()
            now = time.perf_counter()
            step_at.append(now)
            step_launched.append(len(steps))
            # NOTE: with overlap a step() call waits for the batch the previous call launched: its wall time is
            # that batch's; without overlap it is the batch it launched
            owner = before - 1 if not args.no_overlap else before
            if 0 <= owner < len(steps) and steps[owner][1] == 0.0:
                steps[owner] = (steps[owner][0], (now - t0) * 1e3)
            for o in out:
                stamps[o.rid] += [now] * len(o.new_ids)
                if o.finished is not None:
                    done += 1
                    if nxt < num:
                        add(nxt)
                        nxt += 1
        while sched.pending is not None or sched.running:     # the overlap's last step
            sched.step()
        duration = time.perf_counter() - t_start
        if not report:
            return
        ttft, tpot, itl, gaps = [], [], [], []
        for rid, ts in stamps.items():
            ttft.append((ts[0] - sent[rid]) * 1e3)
            if len(ts) > 1:
                tpot.append((ts[-1] - ts[0]) / (len(ts) - 1) * 1e3)
            for a, b in zip(ts, ts[1:]):
                itl.append((b - a) * 1e3)
                gaps.append(((b - a) * 1e3, a, b))
        med = statistics.median(itl)
        kinds = collections.Counter(label[0] for label, _ in steps)
        ext = [ms for label, ms in steps if label[0] == "E" and ms]
        dec = [ms for label, ms in steps if label[0] == "D" and ms]
        summary = {"pass": tag, "mixed": args.mixed, "piecewise": args.piecewise, "chunk": args.chunk,
                   "overlap": not args.no_overlap, "num": num, "conc": args.conc,
                   "duration_s": round(duration, 2),
                   "out_tok_s": round(sum(len(t) for t in stamps.values()) / duration),
                   "ttft_median_ms": round(statistics.median(ttft), 1), "ttft_p99_ms": round(pct(ttft, 0.99), 1),
                   "tpot_median_ms": round(statistics.median(tpot), 2),
                   "itl_median_ms": round(med, 2), "itl_p99_ms": round(pct(itl, 0.99), 2),
                   "itl_p99_over_median": round(pct(itl, 0.99) / med, 2),
                   "itl_mean_ms": round(statistics.mean(itl), 2),
                   "steps": dict(kinds), "decode_step_median_ms": round(statistics.median(dec), 2) if dec else None,
                   "extend_step_median_ms": round(statistics.median(ext), 2) if ext else None,
                   "share_over_40ms": round(sum(1 for x in itl if x > 40) / len(itl), 4), "itls": len(itl)}
        print(json.dumps(summary), flush=True)
        # the longest gaps: which steps returned between the two tokens
        gaps.sort(reverse=True)
        seen, shown = set(), 0
        for ms, a, b in gaps:
            if ms <= 2 * med or shown >= args.show:
                break
            i0, i1 = step_at.index(a), step_at.index(b)
            if (i0, i1) in seen:
                continue
            seen.add((i0, i1))
            shown += 1
            lo, hi = step_launched[max(0, i0 - 1)], step_launched[i1]
            print(f"gap {ms:.1f} ms over steps {i0 + 1}..{i1}: " +
                  " ".join(f"{label}:{s:.1f}" for label, s in steps[lo:hi]))
        # extend steps by size: how a prompt's prefill costs against the decode step
        by = collections.defaultdict(list)
        for label, ms in steps:
            if label[0] == "E" and ms:
                toks, dec_n = label[1:].split("+")
                by[(int(toks) // 256 * 256, int(dec_n) > 0)].append(ms)
        for (lo, mixed), v in sorted(by.items()):
            print(f"extend steps of {lo}-{lo + 255} tokens{' with decodes' if mixed else ''}: {len(v)}, "
                  f"median {statistics.median(v):.1f} ms, max {max(v):.1f} ms")

    # warm-up: the shapes of the load (prompt lengths, batch sizes) once, other prompts, not timed
    run_pass("w", load(args.seed + 1000, args.conc), report=False)
    reqs = load(args.seed, args.num)
    for p in range(args.passes):          # a pass after the first finds its prompts in the radix cache
        run_pass(f"p{p}.", reqs, report=True)


if __name__ == "__main__":
    main()
