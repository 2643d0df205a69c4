"""Speculative decoding on one GPU (issue 13), two parts, results as JSON lines on stdout:

  demo  the trained demo model (bf16, CUDA graphs): decode tok/s and accept length with and without speculation
        at bs 1 / 8 / 32 for several (steps, topk, draft tokens); greedy, ignore_eos, 256 new tokens per request.
        The overlap scheduler is on (the default) in every run unless a setting ends in "/serial" (then
        --disable-overlap-schedule). Also reports how many requests' tokens equal the run without speculation
        (bf16: batch shapes may flip a near tie).
  cost  DeepSeek-V3 full width, 4 layers + its MTP layer, block FP8, dummy weights: GPU time of a plain decode
        step, of the S draft steps, of the verify forward and of the repair, each captured in a CUDA graph and
        timed alone (L2 flushed), at bs 1 and 32 with 512 tokens of context.

    PYTHONPATH=$PWD python benchmarks/spec_decode.py demo
    PYTHONPATH=$PWD python benchmarks/spec_decode.py cost
"""
from __future__ import annotations

import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from mlaserve.config import ServerConfig
from mlaserve.core import SamplingParams
from mlaserve.demo import DEMO_DIR
from mlaserve.ipc.messages import GenerateReqMsg

HEADERS = ["def read_config(path):\n", "class Stack:\n    def __init__(self):\n", "import os\n\ndef list_files(root):\n",
           "def fibonacci(n):\n", "def parse_args(argv=None):\n", "class LRUCache:\n", "def merge_sort(items):\n",
           "def download(url, dest):\n"]


def demo_token_map(size: int) -> str:
    """The `size` most frequent demo tokens of pip's source (the demo's held-out text, not its training text),
    written once per size and reused by the later processes of a run."""
    from mlaserve.tokenizer import load_tokenizer
    from mlaserve.tools.corpus import heldout_files, read_sources
    from mlaserve.tools.token_map import count_tokens, top_ids, write

    path = Path(tempfile.gettempdir()) / f"mlaserve-demo-map{size}.pt"
    if not path.exists():
        tok = load_tokenizer(DEMO_DIR)
        counts = count_tokens(tok.backend, read_sources(sorted(heldout_files())), tok.backend.get_vocab_size())
        write(top_ids(counts, size), path)
    return str(path)


def demo_run(bs: int, spec: tuple[int, int, int] | None, new: int = 256, overlap: bool = True,
             token_map: str | None = None) -> dict:
    from mlaserve.scheduler.scheduler import Scheduler
    from mlaserve.tokenizer import load_tokenizer

    path = str(DEMO_DIR)
    flags = dict(model_path=path, log_level="warning", cuda_graph_bs=[bs], max_running_requests=max(bs, 8),
                 max_total_tokens=65536, disable_overlap_schedule=not overlap)
    if spec:
        flags |= dict(speculative_algorithm="EAGLE", speculative_num_steps=spec[0], speculative_eagle_topk=spec[1],
                      speculative_num_draft_tokens=spec[2], speculative_token_map=token_map)
    sched = Scheduler(ServerConfig.from_flat(**flags), path)
    tok = load_tokenizer(path)
    prompts = [tok.encode(HEADERS[i % len(HEADERS)] + f"    # {i}\n") for i in range(bs)]
    for i, p in enumerate(prompts):
        sched.add_request(GenerateReqMsg(f"r{i}", p, SamplingParams(max_new_tokens=new, temperature=0,
                                                                      ignore_eos=True), seed=i))
    ids: dict[str, list[int]] = {f"r{i}": [] for i in range(bs)}

    def collect(outs):
        for o in outs:
            ids[o.rid] += o.new_ids

    while sum(len(v) > 0 for v in ids.values()) < bs:           # prefill: every request has its first token
        collect(sched.step())
    torch.cuda.synchronize()
    start_tokens, t0 = sum(len(v) for v in ids.values()), time.perf_counter()
    while sched.has_work:
        collect(sched.step())
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    st = sched.get_stats()
    decoded = sum(len(v) for v in ids.values()) - start_tokens
    del sched
    gc.collect()
    torch.cuda.empty_cache()
    return {"bs": bs, "spec": spec, "overlap": overlap, "token_map": token_map and Path(token_map).name,
            "decode_tok_s": decoded / dt, "decode_s": dt,
            "accept_length": st["avg_spec_accept_length"] if spec else 1.0, "ids": ids}


def demo(new: str = "256", which: str = "all") -> None:
    """Each configuration in a process of its own (a clean GPU and allocator), the baseline first. `which`:
    "all" (four settings, then the baseline and (3, 1, 4) again to show the run-to-run spread), "main" (the
    baseline and (3, 1, 4) alternating, three times each), "tree" (the chain (3, 1, 4) beside tree drafts) or
    "overlap" ((3, 1, 4) with the overlap scheduler and without, alternating, beside the baseline) or "map"
    ((3, 1, 4) with draft token maps of 2048 and 512 of the 8192 ids, `--speculative-token-map`)."""
    import subprocess

    order = {"all": ("none", "1,1,2", "2,1,3", "3,1,4", "4,1,5", "none", "3,1,4"),
             "main": ("none", "3,1,4") * 3,
             "tree": ("none", "3,1,4", "3,2,4", "3,4,8", "2,4,4", "4,2,8"),
             "overlap": ("none", "3,1,4", "3,1,4/serial", "none/serial") + ("3,1,4", "3,1,4/serial"),
             "map": ("none", "3,1,4", "3,1,4/map2048", "3,1,4/map512") * 2}[which]
    for bs in ((1, 8) if which == "tree" else (1, 8, 32)):
        rows = {}
        for arg in order:
            spec = None if arg.startswith("none") else arg
            proc = subprocess.run([sys.executable, "-X", "faulthandler", __file__, "demo-one", str(bs), arg, new],
                                  capture_output=True, text=True, timeout=240)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("{")), None)
            if proc.returncode or line is None:
                print(json.dumps({"bs": bs, "spec": spec, "error": proc.stderr[-2000:]}), flush=True)
                continue
            r = json.loads(line)
            rows.setdefault(arg, r)
            base = r if spec is None else rows.get("none")
            if spec is not None and base is not None:
                same = sum(r["ids"][k] == base["ids"][k] for k in base["ids"])
                r |= {"speedup": r["decode_tok_s"] / base["decode_tok_s"], "identical_requests": f"{same}/{bs}"}
            print(json.dumps({k: v for k, v in r.items() if k != "ids"}), flush=True)


def demo_one(bs: str, spec: str, new: str = "256") -> None:
    """`spec`: "none" or "steps,topk,draft_tokens", either followed by "/serial" for --disable-overlap-schedule or
    "/mapN" for a draft token map of the N most frequent tokens."""
    spec, _, mode = spec.partition("/")
    s = None if spec == "none" else tuple(int(x) for x in spec.split(","))
    token_map = demo_token_map(int(mode[3:])) if mode.startswith("map") else None
    print(json.dumps(demo_run(int(bs), s, int(new), overlap=mode != "serial", token_map=token_map)), flush=True)


def cost(layers: str = "4", context: str = "512", steps: str = "3", map_size: str = "0") -> None:
    """`map_size` > 0: the draft head keeps that many token ids (--speculative-token-map; a random set: with dummy
    weights which ids does not matter for the time)."""
    from mlaserve.bench.timing import time_cuda
    from mlaserve.engine.engine import ModelRunner, resolve_for_device
    from mlaserve.kernels.mla_decode import choose_num_kv_splits, decode_programs
    from mlaserve.kvcache.allocator import ReqToTokenPool

    context, steps, map_size = int(context), int(steps), int(map_size)
    cfg = json.loads((Path(__file__).parents[1] / "mlaserve/tools/configs/deepseek-v3.json").read_text())
    cfg["num_hidden_layers"] = int(layers)
    tmp = Path(tempfile.mkdtemp(prefix="spec-v3-"))
    (tmp / "config.json").write_text(json.dumps(cfg))
    token_map = None
    if map_size:
        token_map = str(tmp / "map.pt")
        torch.save(torch.randperm(cfg["vocab_size"], generator=torch.Generator().manual_seed(0))[:map_size], token_map)
    k, max_bs = steps + 1, 32
    server = ServerConfig.from_flat(model_path=str(tmp), load_format="dummy", log_level="warning",
                                    speculative_algorithm="EAGLE", speculative_num_steps=steps,
                                    max_total_tokens=max_bs * (context + 2 * k) + 64, context_length=context + 64,
                                    disable_cuda_graph=True, speculative_token_map=token_map)
    server = resolve_for_device(server, str(tmp))
    runner = ModelRunner(server, str(tmp))
    pool = ReqToTokenPool(max_bs + 1, context + 64, runner.device)
    runner.attach(pool.table)
    spec, dev, heads = runner.spec, runner.device, runner.model.num_local_heads
    for bs in (1, 32):
        rows = torch.tensor([pool.alloc() for _ in range(bs)], dtype=torch.int64)
        perm = torch.randperm(runner.num_slots - 1)[: bs * (context + k)] + 1
        for i, r in enumerate(rows.tolist()):
            pool.write(r, 0, perm[i * (context + k):(i + 1) * (context + k)])
        rows_d = rows.to(dev)
        runner.token_buf[rows_d] = torch.randint(0, cfg["vocab_size"], (bs,), device=dev)
        spec.hidden_buf[rows_d] = torch.randn(bs, cfg["hidden_size"], device=dev, dtype=runner.dtype)
        base = torch.full((bs,), context, dtype=torch.int64, device=dev)
        slots = pool.table[rows_d, context:context + k].long()
        split = {q: choose_num_kv_splits(decode_programs(bs, q * heads), context + 64) for q in (1, k, steps)}
        drafts = spec.draft(rows_d, base, slots, None, split[1])
        _, hidden = spec.verify(rows_d, base, slots, drafts, None, split[k])
        target = torch.cat([drafts, drafts[:, :1]], dim=1)

        def plain():
            ctx = spec._decode_ctx(rows_d, base + 1, base, slots[:, 0], 1, False, None, split[1])
            return runner.model(runner.token_buf[rows_d], base, ctx)

        t = {"decode": time_cuda(plain), "drafts": time_cuda(lambda: spec.draft(rows_d, base, slots, None, split[1])),
             "verify": time_cuda(lambda: spec.verify(rows_d, base, slots, drafts, None, split[k])),
             "repair": time_cuda(lambda: spec.accept(rows_d, base, slots, drafts, target, hidden, None,
                                                      split[steps]))}
        print(json.dumps({"layers": int(layers), "bs": bs, "context": context, "steps": steps, "map_size": map_size,
                          "ms": t,
                          "verify_over_decode": t["verify"] / t["decode"],
                          "drafts_over_decode": t["drafts"] / t["decode"],
                          "drafts_and_repair_over_decode": (t["drafts"] + t["repair"]) / t["decode"],
                          "device": torch.cuda.get_device_name()}), flush=True)
        for r in rows.tolist():
            pool.free(r)


def profile(bs: str, spec: str) -> None:
    """Where the host time of a demo run goes (cProfile, top functions by own time)."""
    import cProfile
    import pstats

    s = None if spec == "none" else tuple(int(x) for x in spec.split(","))
    demo_run(int(bs), s, new=32)                  # warm: Triton compiles, graphs
    prof = cProfile.Profile()
    prof.enable()
    r = demo_run(int(bs), s)
    prof.disable()
    print(json.dumps({k: v for k, v in r.items() if k != "ids"}))
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)




def steptime(bs: str, spec: str) -> None:
    """Per decode step on the host: plan, run (the GPU work, synchronised) and process, median ms over a run."""
    import statistics

    from mlaserve.scheduler.scheduler import Scheduler
    from mlaserve.tokenizer import load_tokenizer

    s = None if spec == "none" else tuple(int(x) for x in spec.split(","))
    path = str(DEMO_DIR)
    gpu = torch.cuda.is_available()
    flags = dict(model_path=path, log_level="warning", max_running_requests=max(int(bs), 8),
                 max_total_tokens=65536, disable_overlap_schedule=True) | ({"cuda_graph_bs": [int(bs)]} if gpu else {})
    if s:
        flags |= dict(speculative_algorithm="EAGLE", speculative_num_steps=s[0])
    sched = Scheduler(ServerConfig.from_flat(**flags), path)
    tok = load_tokenizer(path)
    for i in range(int(bs)):
        sched.add_request(GenerateReqMsg(f"r{i}", tok.encode(HEADERS[i % len(HEADERS)]),
                                         SamplingParams(max_new_tokens=256, temperature=0, ignore_eos=True), seed=i))
    parts: dict[str, list[float]] = {"plan": [], "run": [], "process": []}
    n = 0
    prof = None
    if os.environ.get("STEPTIME_PROFILE"):
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    while sched.has_work:
        t0 = time.perf_counter()
        batch = sched.plan()
        t1 = time.perf_counter()
        if batch is None:
            continue
        out = sched.run(batch)
        if gpu:
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        sched.process(batch, out)
        sched.step_outbox()
        t3 = time.perf_counter()
        n += 1
        if n > 3:
            for k, v in zip(parts, (t1 - t0, t2 - t1, t3 - t2)):
                parts[k].append(v * 1e3)
    if prof is not None:
        import pstats

        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats("mlaserve|import_utils|importlib", 30)
    print(json.dumps({"bs": int(bs), "spec": s, "steps": n, **{k: round(statistics.median(v), 3) for k, v in parts.items()},
                      "accept_length": sched.get_stats()["avg_spec_accept_length"]}), flush=True)


if __name__ == "__main__":
    {"demo": demo, "demo-one": demo_one, "cost": cost, "profile": profile, "steptime": steptime}[sys.argv[1]](*sys.argv[2:])
