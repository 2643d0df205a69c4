"""Where a synchronous decode step's time goes besides the graph's GPU time (`bench one-batch`'s step minus its
"GPU ms"): the host before the graph is queued, the GPU's graph, the sampling launched after it, and the wait.

Runs `bench one-batch`'s decode loop (dummy weights, input 256) with each step cut at the engine's three calls:
    t0 -> launch_forward -> t1 -> launch_sample -> t2 -> resolve -> t3,  CUDA events e0 (at t0), e1 (t1), e2 (t2).
Prints medians per batch size: host ms of each part, GPU ms e0->e1 (host wait + graph) and e1->e2 (sampling),
the graph alone (`graph_replay_s`), the host time to the graph runner's `replay_host` and inside it (staging
writes, the input copy and event, the graph's launch call), and a cProfile of 5 more steps of the largest size.
--wait spin: every wait on the GPU (torch.cuda.synchronize, Event.synchronize) polls its event from Python instead,
so the host thread never blocks in the driver (does the host part shrink when the thread stays busy?)."""
import argparse
import cProfile
import pstats
import statistics
import time

import torch

from mlaserve.bench.one_batch import build_parser, build_runner, graph_replay_s, model_dir
from mlaserve.core import Batch, ForwardMode, Req, SamplingParams

ap = argparse.ArgumentParser()
ap.add_argument("--model-config", default="mlaserve/tools/configs/deepseek-v2-lite.json")
ap.add_argument("--bs", type=int, nargs="+", default=[1, 16, 64])
ap.add_argument("--steps", type=int, default=31)
ap.add_argument("--wait", choices=("block", "spin"), default="block")
a = ap.parse_args()
if a.wait == "spin":
    def _spin_event(self) -> None:
        while not self.query():
            pass

    def _spin_sync(device=None) -> None:
        ev = torch.cuda.Event()
        ev.record()
        _spin_event(ev)

args = build_parser().parse_args(["--load-format", "dummy", "--model-config", a.model_config, "--batch-size",
                                  *map(str, a.bs), "--input-len", "256", "--output-len", str(a.steps + 2)])
runner, pool, alloc = build_runner(args, model_dir(args))
if a.wait == "spin":                             # from here on (startup as usual)
    torch.cuda.Event.synchronize = _spin_event
    torch.cuda.synchronize = _spin_sync
vocab = runner.cfg.vocab_size


def prefill(bs: int) -> list[Req]:
    reqs = [Req(f"p{i}", torch.randint(2, vocab, (256,)).tolist(),
                SamplingParams(max_new_tokens=a.steps + 1, temperature=0, ignore_eos=True), seed=i) for i in range(bs)]
    slots = alloc.alloc(bs * 256)
    for i, r in enumerate(reqs):
        r.req_pool_idx = pool.alloc()
        pool.write(r.req_pool_idx, 0, slots[i * 256:(i + 1) * 256])
        r.kv_len = 256
    out = runner.forward(Batch(ForwardMode.EXTEND, reqs, [t for r in reqs for t in r.input_ids], slots, [0] * bs,
                               [256] * bs, [True] * bs))
    for r, tok in zip(reqs, out.next_ids):
        r.output_ids.append(tok)
    return reqs


def decode_batch(reqs: list[Req]) -> Batch:
    s = alloc.alloc(len(reqs))
    prefix = [r.kv_len for r in reqs]
    for r, slot in zip(reqs, s):
        pool.write(r.req_pool_idx, r.kv_len, slot.view(1))
        r.kv_len += 1
    return Batch(ForwardMode.DECODE, reqs, [r.output_ids[-1] for r in reqs], s, prefix, [1] * len(reqs),
                 [True] * len(reqs))


def release(reqs: list[Req]) -> None:
    for r in reqs:
        alloc.free(pool.slots(r.req_pool_idx, r.kv_len))
        pool.free(r.req_pool_idx)


def ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:7.3f}"


print(f"waits: {a.wait}")
print(f"{'bs':>3} {'step':>7} {'fwd host':>8} {'smp host':>8} {'resolve':>7} | {'e0-e1':>7} {'e1-e2':>7} "
      f"{'graph':>7} | {'to replay_host':>14} {'staging':>7} {'copy+ev':>7} {'launch':>7}   (ms, medians of "
      f"{a.steps - 1} steps)")
marks: list[float] = []                     # perf_counter marks inside replay_host (the instrumented copy below)
graphs = runner.graphs


def replay_host(positions, out_slots, req_pool_idx, pad_to=None):
    """graph.DecodeGraphRunner.replay_host (captured graphs, no DP attention) with time marks: keep it in step with
    that method (a stale copy once left the row count unwritten, and the bs-64 graphs routed almost no rows)."""
    marks.append(time.perf_counter())
    bs = len(positions)
    cbs = graphs._capture_size(bs)
    i = graphs.next_staging
    graphs.next_staging = (i + 1) % graphs.STAGING
    if graphs.staged[i] is not None:
        graphs.staged[i].synchronize()
    host = graphs.staging_np[i]
    host[0, :bs] = positions
    host[1, :bs] = out_slots.numpy()
    host[2, :bs] = req_pool_idx
    host[:2, bs:cbs] = 0
    host[2, bs:cbs] = graphs.dummy_req
    host[3, 0] = bs                              # the MoE's row mask: rows past bs are padding (no DP attention here)
    marks.append(time.perf_counter())
    graphs.inputs.copy_(graphs.staging[i], non_blocking=True)
    graphs.staged[i] = torch.cuda.Event()
    graphs.staged[i].record()
    marks.append(time.perf_counter())
    graph, out = graphs.pick(cbs, positions)                   # (as the runner's: the chain graph at bs 1)
    graph.replay()
    marks.append(time.perf_counter())
    return out[:bs], graphs.req_pool_idx[:bs]


graphs.replay_host = replay_host


def step(reqs: list[Req], cols: dict | None) -> None:
    batch = decode_batch(reqs)
    torch.cuda.synchronize()
    e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    marks.clear()
    t0 = time.perf_counter()
    e[0].record()
    fwd = runner.launch_forward(batch)
    t1 = time.perf_counter()
    e[1].record()
    pend = runner.launch_sample(fwd)
    t2 = time.perf_counter()
    e[2].record()
    out = runner.resolve(pend)
    t3 = time.perf_counter()
    torch.cuda.synchronize()
    for r, tok in zip(reqs, out.next_ids):
        r.output_ids.append(tok)
    if cols is None:
        return
    for k, v in (("step", t3 - t0), ("fwd", t1 - t0), ("smp", t2 - t1), ("res", t3 - t2),
                 ("g01", e[0].elapsed_time(e[1]) / 1e3), ("g12", e[1].elapsed_time(e[2]) / 1e3)):
        cols[k].append(v)
    if len(marks) == 4:
        for k, v in zip(("enter", "staging", "copy", "launch"), (marks[0] - t0, *(y - x for x, y in zip(marks, marks[1:])))):
            cols[k].append(v)


prof_bs = max(a.bs)
prof = cProfile.Profile()
for bs in a.bs:
    reqs = prefill(bs)
    cols: dict[str, list[float]] = {k: [] for k in ("step", "fwd", "smp", "res", "g01", "g12", "enter", "staging",
                                                     "copy", "launch")}
    step(reqs, None)                             # the first step of a size pays one-time costs
    for _ in range(a.steps - 1):
        step(reqs, cols)
    if bs == prof_bs:                            # more steps under the profiler, apart from the timed ones
        prof.enable()
        for _ in range(5):
            step(reqs, None)
        prof.disable()
    release(reqs)
    g = graph_replay_s(runner, bs, 256 + a.steps)          # the last step's sequence (its graph)
    inner = " ".join(ms(cols[k]) for k in ("staging", "copy", "launch")) if cols["enter"] else "(no graph)"
    print(f"{bs:3d} {ms(cols['step'])} {ms(cols['fwd'])} {ms(cols['smp'])} {ms(cols['res'])} | "
          f"{ms(cols['g01'])} {ms(cols['g12'])} {g * 1e3 if g else float('nan'):7.3f} | "
          f"{ms(cols['enter']) if cols['enter'] else '':>14} {inner}")
print(f"\nhost calls of 5 more bs {prof_bs} steps (cProfile, by own time):")
pstats.Stats(prof).sort_stats("tottime").print_stats(18)
