"""`mlaserve bench one-batch`: prefill one batch, then decode it step by step; latency and throughput beside
the floor of DESIGN.md sec. 5 (bytes / measured copy bandwidth; FLOPs / measured matmul rate), and with
`--hf-peer` Hugging Face transformers on the same config in the same run. `--tp-size 1 2` runs each
tensor-parallel size in turn (one spawned process per rank), beside the floor of one rank and the time the
step's all-reduces take alone; `--ep-size 1 2` also runs each TP size with expert parallelism over its ranks.

    mlaserve bench one-batch --model-path DIR --batch-size 1 16 64 --input-len 256 --output-len 32
    mlaserve bench one-batch --load-format dummy --model-config config.json --batch-size 1 16 64 --hf-peer
    mlaserve bench one-batch --load-format dummy --model-config config.json --tp-size 1 2
    mlaserve bench one-batch --load-format dummy --model-config config.json --tp-size 2 --ep-size 1 2
    mlaserve bench one-batch --model-path DIR --speculative-algorithm EAGLE --speculative-num-steps 3
    mlaserve bench one-batch --model-path DIR --speculative-algorithm EAGLE --speculative-eagle-topk 4 \
        --speculative-num-draft-tokens 8
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from mlaserve.bench.floor import decode_step_bytes, prefill_flops
from mlaserve.config import ConfigError, ServerConfig, add_refused_flags
from mlaserve.config_resolve import DEFAULT_SPEC_STEPS
from mlaserve.kernels import pdl
from mlaserve.core import Batch, ForwardMode, Req, SamplingParams
from mlaserve.distributed import RankGroup, spawn_ranks
from mlaserve.engine.engine import ModelRunner, resolve_for_device
from mlaserve.engine.spec_tree import slots_per_step
from mlaserve.kvcache.allocator import ReqToTokenPool, TokenSlotAllocator


def sync(group: RankGroup | None = None) -> None:
    """Wait for this GPU; with a group of several ranks also for every rank to get here, so that a timed region
    starts together on all of them (else its first collective waits out the ranks' skew and counts it)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    if group is not None and group.size > 1:
        dist.barrier(group=group.cpu_group)


PREFILL_REPEATS = 3
DEFAULT_PROFILE_DIR = "/tmp/mlaserve-profile"


def model_dir(args: argparse.Namespace) -> str:
    if args.model_path:
        return args.model_path
    tmp = Path(tempfile.mkdtemp(prefix="mlaserve-dummy-"))
    (tmp / "config.json").write_text(Path(args.model_config).read_text())
    return str(tmp)


def bench_config(args: argparse.Namespace, path: str, tp: int, ep: int, device: str | None = None) -> ServerConfig:
    """The resolved server config one bench run at (tp, ep) builds its runner from (ConfigError when refused)."""
    max_bs, width = max(args.batch_size), _table_width(args)
    context = getattr(args, "context_length", None) or width
    server = ServerConfig.from_flat(model_path=path, load_format=args.load_format, dtype=args.dtype,
                                    tp_size=tp, ep_size=ep, device=device or args.device,
                                    max_total_tokens=max(max_bs * width, context) + 64,
                                    disable_cuda_graph=args.disable_cuda_graph,
                                    attention_backend=args.attention_backend,
                                    context_length=context,
                                    enable_torch_compile=args.enable_torch_compile,
                                    torch_compile_max_bs=args.torch_compile_max_bs,
                                    cuda_graph_max_bs=args.cuda_graph_max_bs,
                                    enable_piecewise_cuda_graph=args.enable_piecewise_cuda_graph,
                                    piecewise_cuda_graph_max_tokens=args.piecewise_cuda_graph_max_tokens,
                                    speculative_algorithm=args.speculative_algorithm,
                                    speculative_num_steps=args.speculative_num_steps,
                                    speculative_eagle_topk=args.speculative_eagle_topk,
                                    speculative_num_draft_tokens=args.speculative_num_draft_tokens)
    server = resolve_for_device(server, path)
    if not server.sched.disable_cuda_graph:           # capture (and compile) every batch size the bench runs
        graph_bs = min(max_bs, args.cuda_graph_max_bs or max_bs)
        compile_bs = min(graph_bs, args.torch_compile_max_bs or graph_bs)
        sched = replace(server.sched, cuda_graph_bs=None, cuda_graph_max_bs=graph_bs,
                        torch_compile_max_bs=compile_bs if args.enable_torch_compile else 0)
        server = resolve_for_device(replace(server, sched=sched), path)
    return server


def _table_width(args: argparse.Namespace) -> int:
    # NOTE: speculative rows step every request until the last has --output-len tokens, so one may run up to
    # (steps + 1) tokens a step for output_len steps (`_spec_decode`): its table row and the pool make room for that
    grow = (args.speculative_num_steps or DEFAULT_SPEC_STEPS) + 1 if args.speculative_algorithm else 1
    return args.input_len + args.output_len * grow + 8


def build_runner(args: argparse.Namespace, path: str, group: RankGroup | None = None,
                 device: str | None = None) -> tuple[ModelRunner, ReqToTokenPool, TokenSlotAllocator]:
    max_bs, width = max(args.batch_size), _table_width(args)
    server = bench_config(args, path, group.size if group else 1, getattr(args, "ep", 1), device)
    runner = ModelRunner(server, path, group)
    reach = _spec_slots(runner) - 1 if runner.spec is not None else 0   # a step's table columns past the end
    pool = ReqToTokenPool(max_bs + 1, width + reach, runner.device)
    runner.attach(pool.table)
    runner.init_cuda_graphs(pool.table, pool.alloc())
    return runner, pool, TokenSlotAllocator(runner.num_slots)


def eager_prefill(model_config: str, length: int) -> tuple[ModelRunner, Batch]:
    """An eager runner (dummy weights of `model_config`, no CUDA graphs) and the extend batch of one random prompt of
    `length` tokens, its slots written: what benchmarks/profile_prefill.py and ab_prefill_host.py run again and
    again (the same batch rewrites the same KV rows)."""
    args = build_parser().parse_args(["--load-format", "dummy", "--model-config", model_config, "--batch-size", "1",
                                      "--input-len", str(length), "--output-len", "8", "--disable-cuda-graph"])
    runner, pool, alloc = build_runner(args, model_dir(args))
    req = Req("p", torch.randint(2, runner.cfg.vocab_size, (length,)).tolist(),
              SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True), seed=0)
    slots = alloc.alloc(length)
    req.req_pool_idx = pool.alloc()
    pool.write(req.req_pool_idx, 0, slots)
    return runner, Batch(ForwardMode.EXTEND, [req], list(req.input_ids), slots, [0], [length], [True])


def one_batch(runner: ModelRunner, pool: ReqToTokenPool, alloc: TokenSlotAllocator, bs: int, input_len: int,
              output_len: int, graph_stats: bool = True) -> dict:
    """One prefill of `bs` random prompts, then decode steps to `output_len` tokens: the timings as a row.
    graph_stats: also the captured graph's GPU time and kernel count (`graph_stats_of`), which run the torch
    profiler: False under another profiler (--profile), which a nested one would stop."""
    vocab = runner.cfg.vocab_size
    reqs = [Req(f"b{i}", torch.randint(2, vocab, (input_len,)).tolist(),
                SamplingParams(max_new_tokens=output_len, temperature=0, ignore_eos=True), seed=i) for i in range(bs)]
    slots = alloc.alloc(bs * input_len)
    for i, r in enumerate(reqs):
        r.req_pool_idx = pool.alloc()
        pool.write(r.req_pool_idx, 0, slots[i * input_len:(i + 1) * input_len])
        r.kv_len = input_len
    batch = Batch(ForwardMode.EXTEND, reqs, [t for r in reqs for t in r.input_ids], slots, [0] * bs,
                  [input_len] * bs, [True] * bs)
    # NOTE: the first prefill of a shape pays one-time costs (kernel compilation and cache loads, cuBLAS heuristics):
    # the figure is the median of PREFILL_REPEATS runs after it (the same batch again rewrites the same KV rows)
    times = []
    for _ in range(1 + (PREFILL_REPEATS if runner.device.type == "cuda" else 0)):
        sync(runner.group)
        t0 = time.perf_counter()
        out = runner.forward(batch)
        sync()
        times.append(time.perf_counter() - t0)
    prefill_s = statistics.median(times[1:] or times)
    steps = []
    for r, tok in zip(reqs, out.next_ids):
        r.output_ids.append(tok)
    if runner.spec is not None:
        return _spec_decode(runner, pool, alloc, reqs, output_len) | {
            "batch_size": bs, "input_len": input_len, "output_len": output_len, "prefill_s": prefill_s,
            "prefill_tok_s": bs * input_len / prefill_s, "graph_replay_s": None}
    for _ in range(output_len - 1):
        s = alloc.alloc(bs)
        prefix = [r.kv_len for r in reqs]
        for r, slot in zip(reqs, s):
            pool.write(r.req_pool_idx, r.kv_len, slot.view(1))
            r.kv_len += 1
        batch = Batch(ForwardMode.DECODE, reqs, [r.output_ids[-1] for r in reqs], s, prefix, [1] * bs, [True] * bs)
        sync(runner.group)
        t0 = time.perf_counter()
        out = runner.forward(batch)
        sync()
        steps.append(time.perf_counter() - t0)
        for r, tok in zip(reqs, out.next_ids):
            r.output_ids.append(tok)
    for r in reqs:
        alloc.free(pool.slots(r.req_pool_idx, r.kv_len))
        pool.free(r.req_pool_idx)
    step = statistics.median(steps) if steps else float("nan")
    return (graph_stats_of(runner, bs, input_len + output_len - 1) if graph_stats else {}) | {
        "batch_size": bs, "input_len": input_len, "output_len": output_len, "prefill_s": prefill_s,
        "prefill_tok_s": bs * input_len / prefill_s, "decode_step_s": step, "decode_tok_s": bs / step}


def graph_stats_of(runner: ModelRunner, bs: int, seq_len: int) -> dict:
    return {"graph_replay_s": graph_replay_s(runner, bs, seq_len),
            "kernels_per_step": graph_kernels(runner, bs, seq_len)}


def _spec_slots(runner: ModelRunner) -> int:
    return slots_per_step(runner.spec.steps, runner.spec.topk, runner.spec.num_draft)


def _spec_decode(runner: ModelRunner, pool: ReqToTokenPool, alloc: TokenSlotAllocator, reqs: list[Req],
                 output_len: int) -> dict:
    """Speculative decode steps until every request has `output_len` tokens: k = `slots_per_step` slots per
    request a step, those past the accepted tokens freed after it (as the scheduler does). A request with its tokens
    keeps stepping, so every step runs the whole batch; its KV follows every accepted token, as the device's base
    length does (`SpecDecoder.launch`). Step time, and from every token the steps accepted (at the batch size
    throughout): tokens per second and accept length."""
    bs, k = len(reqs), _spec_slots(runner)
    steps, made, t_all = [], 0, 0.0             # made: tokens accepted, the ones past --output-len too
    while any(len(r.output_ids) < output_len for r in reqs):
        s = alloc.alloc(bs * k)
        prefix = [r.kv_len for r in reqs]
        for i, r in enumerate(reqs):
            pool.write(r.req_pool_idx, r.kv_len, s[i * k:(i + 1) * k])
            r.kv_len += k
        batch = Batch(ForwardMode.DECODE, reqs, [], s, prefix, [k] * bs, [True] * bs)
        sync(runner.group)
        t0 = time.perf_counter()
        out = runner.spec_step(batch)
        sync()
        steps.append(time.perf_counter() - t0)
        t_all += steps[-1]
        for r, toks, base in zip(reqs, out.tokens, prefix):
            r.output_ids += toks[: output_len - len(r.output_ids)]
            made += len(toks)
            # NOTE: the step's newest token and the accepted drafts now have KV (the bonus token not yet), whether
            # counted or not: the device's base moved by len(toks), so the next step's slots go there
            keep = base + len(toks)
            alloc.free(pool.slots(r.req_pool_idx, r.kv_len)[keep:])
            r.kv_len = keep
    for r in reqs:
        alloc.free(pool.slots(r.req_pool_idx, r.kv_len))
        pool.free(r.req_pool_idx)
    spec = runner.spec
    return {"engine": f"mlaserve spec ({spec.steps}, {spec.topk}, {spec.num_draft})", "decode_step_s": statistics.median(steps),
            "decode_tok_s": made / t_all, "decode_token_time_s": bs * t_all / made,
            "accept_length": made / (len(steps) * bs)}


def graph_replay_s(runner: ModelRunner, bs: int, seq_len: int) -> float | None:
    """GPU time of one decode step alone (the captured graph of a step whose longest sequence is seq_len, replayed
    on the last inputs), or None."""
    g = runner.graphs
    if g is None or not g.can_run(bs):
        return None
    graph = g.graph_of(bs, seq_len)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(20):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def graph_kernels(runner: ModelRunner, bs: int, seq_len: int) -> int | None:
    """GPU kernels one decode step launches (`graph_replay_s`'s graph replayed once under the torch profiler), or
    None."""
    g = runner.graphs
    if g is None or not g.can_run(bs):
        return None
    graph = g.graph_of(bs, seq_len)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.key.startswith(("Memset", "Memcpy")))


def allreduce_s(runner: ModelRunner, bs: int) -> float:
    """Time of the step's all-reduces alone (two per layer and the embedding's, [bs, hidden] in the activation
    dtype), back to back: in a CUDA graph on GPUs, eagerly on the CPU. Collective: every rank calls it."""
    tp, n = runner.group.tp, 2 * runner.cfg.num_hidden_layers + 1
    x = torch.zeros(bs, runner.cfg.hidden_size, dtype=runner.dtype, device=runner.device)
    if runner.device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(n):
            tp.all_reduce(x)
        return time.perf_counter() - t0
    from mlaserve.bench.timing import time_cuda

    return time_cuda(lambda: [tp.all_reduce(x) for _ in range(n)], warmup=3, iters=10, flush_l2=False) / 1e3


def add_floor(row: dict, runner: ModelRunner, ceil: dict) -> dict:
    cfg, bs = runner.cfg, row["batch_size"]
    ctx = row["input_len"] + row["output_len"] // 2
    kv_bytes = runner.pool.buffers[0].element_size()
    parts = decode_step_bytes(cfg, bs, ctx, fp8=cfg.is_fp8 and not runner.server.load.dequant_fp8,
                              kv_bytes=kv_bytes, tp=runner.group.size)
    nbytes = parts["total"]
    row["decode_floor_s"] = nbytes / ceil["copy_bps"]
    row["floor_parts_s"] = {"weights": (parts["attention"] + parts["dense_mlp"] + parts["moe"]) / ceil["copy_bps"],
                            "kv": parts["kv_cache"] / ceil["copy_bps"], "lm_head": parts["lm_head"] / ceil["copy_bps"]}
    row["num_layers"] = cfg.num_hidden_layers
    # NOTE: speculative rows: the time per bs tokens (one plain step's worth), which can beat the plain floor
    row["decode_frac_floor"] = row["decode_floor_s"] / row.get("decode_token_time_s", row["decode_step_s"])
    flops = prefill_flops(cfg, row["input_len"]) * bs
    rate = ceil["fp8_flops"] if cfg.is_fp8 and not runner.server.load.dequant_fp8 else ceil["bf16_flops"]
    row["prefill_tflops"] = flops / row["prefill_s"] / 1e12
    row["prefill_frac_rate"] = flops / row["prefill_s"] / rate
    return row


def table(rows: list[dict], title: str) -> str:
    lines = [f"### {title}", "", "| engine | bs | in | out | prefill ms | prefill tok/s | prefill TFLOP/s (of rate) | "
             "decode step ms | GPU ms (graph replay) | all-reduces ms (of step) | decode tok/s | floor ms | of floor | "
             "floor parts ms (weights / KV / lm_head) | kernels per step (per layer) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pf = f"{r['prefill_tflops']:.0f} ({r['prefill_frac_rate']:.0%})" if "prefill_tflops" in r else "-"
        fl = f"{r['decode_floor_s'] * 1e3:.2f}" if "decode_floor_s" in r else "-"
        fr = f"{r['decode_frac_floor']:.0%}" if "decode_frac_floor" in r else "-"
        gs = f"{r['graph_replay_s'] * 1e3:.2f}" if r.get("graph_replay_s") else "-"
        ar = f"{r['allreduce_s'] * 1e3:.2f} ({r['allreduce_s'] / r['decode_step_s']:.0%})" if r.get("allreduce_s") else "-"
        engine = r.get("engine", "mlaserve") + (f", accept {r['accept_length']:.2f}" if "accept_length" in r else "")
        fp = r.get("floor_parts_s")
        parts = " / ".join(f"{fp[k] * 1e3:.2f}" for k in ("weights", "kv", "lm_head")) if fp else "-"
        kn = r.get("kernels_per_step")
        kern = f"{kn} ({kn / r['num_layers']:.1f})" if kn and r.get("num_layers") else "-"
        lines.append(f"| {engine} | {r['batch_size']} | {r['input_len']} | {r['output_len']} | "
                     f"{r['prefill_s'] * 1e3:.1f} | {r['prefill_tok_s']:.0f} | {pf} | {r['decode_step_s'] * 1e3:.2f} | {gs} | "
                     f"{ar} | {r['decode_tok_s']:.0f} | {fl} | {fr} | {parts} | {kern} |")
    return "\n".join(lines)


def bench_rank(group: RankGroup | None, args: argparse.Namespace, path: str, ceil: dict) -> tuple[list, object, float]:
    """Build one rank's runner and run every batch size (every rank runs the same batches; rank 0's rows count)."""
    rank = group.info.rank if group else 0
    device = f"cuda:{rank}" if group and torch.cuda.is_available() and args.device in ("auto", "cuda") else None
    t0 = time.perf_counter()
    runner, pool, alloc = build_runner(args, path, group, device)
    startup = time.perf_counter() - t0
    torch.manual_seed(0)                           # the same prompts on every rank
    for bs in args.batch_size:                     # warm-up: Triton compiles every shape the runs will use
        one_batch(runner, pool, alloc, bs, args.input_len, 3)
    rows = []
    for bs in args.batch_size:
        if args.profile and bs == args.batch_size[-1] and rank == 0:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
                row = one_batch(runner, pool, alloc, bs, args.input_len, args.output_len, graph_stats=False)
            if runner.spec is None:
                row |= graph_stats_of(runner, bs, args.input_len + args.output_len - 1)
            out = Path(args.profile_dir or DEFAULT_PROFILE_DIR)       # (a parser of build_parser's without main)
            out.mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(out / f"one_batch_bs{bs}.json"))
            (out / f"one_batch_bs{bs}.txt").write_text(
                prof.key_averages().table(sort_by="cuda_time_total", row_limit=40))
        else:
            row = one_batch(runner, pool, alloc, bs, args.input_len, args.output_len)
        if runner.group.size > 1:
            ep = runner.server.parallel.ep_size
            row |= {"engine": row.get("engine", "mlaserve") + f" tp {runner.group.size}" + (f" ep {ep}" if ep > 1 else ""),
                    "allreduce_s": allreduce_s(runner, bs)}
        rows.append(add_floor(row, runner, ceil))
        if rank == 0:
            print(json.dumps(rows[-1]), flush=True)
    return rows, runner.cfg, startup


def build_parser() -> argparse.ArgumentParser:
    """The `bench one-batch` flags (also how benchmarks/profile_*.py describe the runner they build)."""
    ap = argparse.ArgumentParser(prog="mlaserve bench one-batch", description=__doc__.split("\n")[0])
    ap.add_argument("--model-path", "--model")
    ap.add_argument("--model-config", help="config.json for --load-format dummy")
    ap.add_argument("--load-format", default="auto", choices=("auto", "safetensors", "dummy"))
    ap.add_argument("--batch-size", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--input-len", "--input", type=int, default=256)         # SGLang's bench_one_batch spellings too
    ap.add_argument("--output-len", "--output", type=int, default=32)
    ap.add_argument("--context-length", type=int, default=None,
                    help="the longest sequence the runner is sized for, as a server's (the decode graphs' split "
                         "counts follow it); default input + output + 8, the least the run needs")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--attention-backend", default="auto", choices=("auto", "triton", "torch"))
    ap.add_argument("--tp-size", "--tp", type=int, nargs="+", default=[1], help="tensor-parallel sizes to run in turn")
    ap.add_argument("--ep-size", type=int, nargs="+", default=[1],
                    help="expert-parallel sizes to run each TP size with (dividing it; others are skipped)")
    ap.add_argument("--disable-cuda-graph", action="store_true")
    ap.add_argument("--disable-custom-all-reduce", action="store_true",
                    help="every all-reduce on NCCL (default: decode's over peer buffers where the GPUs allow)")
    ap.add_argument("--enable-torch-compile", action="store_true", help="torch.compile the decode step (in graphs)")
    ap.add_argument("--torch-compile-max-bs", type=int, default=None,
                    help="compile the batch sizes up to this only (default: every --batch-size)")
    ap.add_argument("--cuda-graph-max-bs", type=int, default=None,
                    help="capture the batch sizes up to this only, larger ones run eagerly "
                         "(default: every --batch-size)")
    ap.add_argument("--enable-piecewise-cuda-graph", action="store_true",
                    help="run prefills of up to --piecewise-cuda-graph-max-tokens tokens as piecewise CUDA graphs")
    ap.add_argument("--piecewise-cuda-graph-max-tokens", type=int, default=None,
                    help="largest prefill (tokens) run through piecewise graphs (default 4096)")
    ap.add_argument("--speculative-algorithm", choices=("EAGLE", "NEXTN"), default=None,
                    help="decode with the checkpoint's MTP layer drafting (reports the accept length)")
    ap.add_argument("--speculative-num-steps", type=int, default=None, help="draft steps per verify (default 3)")
    ap.add_argument("--speculative-eagle-topk", type=int, default=None, help="draft branches per step (default 1)")
    ap.add_argument("--speculative-num-draft-tokens", type=int, default=None,
                    help="tokens verified per step (default num_steps + 1)")
    ap.add_argument("--profile", action="store_true", help="write a torch profiler trace of the last batch size")
    ap.add_argument("--profile-dir", default=None, help="where --profile writes (default /tmp/mlaserve-profile)")
    ap.add_argument("--hf-peer", action="store_true", help="then run HF transformers on the same config")
    ap.add_argument("--output-file", help="append the markdown table and JSON rows here")
    add_refused_flags(ap)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if not args.model_path and not (args.load_format == "dummy" and args.model_config):
        ap.error("give --model-path, or --load-format dummy with --model-config")
    if args.context_length is not None and args.context_length < _table_width(args):
        ap.error(f"--context-length {args.context_length} is shorter than the run's sequences "
                 f"({_table_width(args)} tokens: input + output + 8)")
    # flags that would act on nothing: one line, as `serve` refuses them
    if args.model_path and args.model_config:
        ap.error("--model-config: the shapes come from --model-path's config.json; give one of the two")
    if args.profile_dir is not None and not args.profile:
        ap.error("--profile-dir: acts only with --profile")
    path = model_dir(args)
    combos = [(tp, ep) for tp in args.tp_size for ep in args.ep_size if not tp % ep]
    for tp, ep in combos:                  # every refusal before any run: one line, as `serve` gives it
        try:
            bench_config(args, path, tp, ep)
        except ConfigError as e:
            ap.error(str(e))
    from mlaserve.bench.timing import Ceilings

    ceil = Ceilings.measure() if torch.cuda.is_available() else {"copy_bps": float("nan"), "bf16_flops": float("nan"),
                                                                  "fp8_flops": float("nan")}
    rows, cfg, startup = [], None, {}
    for tp, ep in [(tp, ep) for tp in args.tp_size for ep in args.ep_size]:
        if tp % ep:
            print(f"skipping --tp-size {tp} --ep-size {ep}: --ep-size must divide --tp-size", flush=True)
            continue
        run, label = argparse.Namespace(**vars(args), ep=ep), f"tp {tp}" + (f" ep {ep}" if ep > 1 else "")
        if tp == 1:
            got, cfg, startup[label] = bench_rank(None, run, path, ceil)
        else:
            device = "cuda" if torch.cuda.is_available() and args.device in ("auto", "cuda") else "cpu"
            got, cfg, startup[label] = spawn_ranks(bench_rank, tp, run, path, ceil, device=device,
                                                   peer_all_reduce=False if args.disable_custom_all_reduce else None)[0]
        rows += got
    gc.collect()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    if args.hf_peer:
        from mlaserve.bench.hf_peer import run_hf

        for bs in args.batch_size:
            rows.append(run_hf(path, bs, args.input_len, args.output_len, args.dtype))
            print(json.dumps(rows[-1]), flush=True)
    uses_pdl = pdl.active(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    title = (f"one-batch, {cfg.architecture} hidden {cfg.hidden_size} x {cfg.num_hidden_layers} layers, "
             f"{'FP8' if cfg.is_fp8 else args.dtype}, {torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}, "
             f"{datetime.date.today()}; copy {ceil['copy_bps'] / 1e12:.2f} TB/s, bf16 {ceil['bf16_flops'] / 1e12:.0f} "
             f"TFLOP/s, fp8 {ceil['fp8_flops'] / 1e12:.0f} TFLOP/s; PDL {'on' if uses_pdl else 'off'}; "
             f"model build + load + graph capture "
             + ", ".join(f"{s:.1f} s ({label})" for label, s in startup.items()))
    text = table(rows, title)
    print(text)
    if args.output_file:
        with open(args.output_file, "a") as f:
            f.write(text + "\n\n<!-- rows: " + json.dumps(rows) + " -->\n\n")
    return 0
