"""Prefill through piecewise CUDA graphs (`--enable-piecewise-cuda-graph`) against the eager forward, in one runner
(dummy weights, full width, batch 1 and a ragged batch): the two alternate, median of 7 runs each, wall time of a
synchronised prefill and GPU time alone (events around it, queued behind a GPU sleep so the host is ahead);
beside them the prefill's share of the tensor-core rate, and how far the piecewise logits are from the eager ones.

    PYTHONPATH=$PWD python benchmarks/piecewise_ab.py --model-config mlaserve/tools/configs/deepseek-v2-lite.json \
        --len 256 1000 4096
"""
import argparse
import statistics
import time

import torch

from mlaserve.bench.floor import prefill_flops
from mlaserve.bench.one_batch import build_parser, build_runner, model_dir
from mlaserve.bench.timing import Ceilings, wall_and_gpu_s
from mlaserve.core import Batch, ForwardMode, Req, SamplingParams
from mlaserve.engine.forward_batch import build_context

ap = argparse.ArgumentParser()
ap.add_argument("--model-config", default="mlaserve/tools/configs/deepseek-v2-lite.json")
ap.add_argument("--len", type=int, nargs="+", default=[256, 1000, 4096])
ap.add_argument("--ragged", type=int, nargs="*", default=[700, 1300, 90, 1],
                help="also one batch of requests of these lengths (a 1-token request: a decode-sized extend)")
cli = ap.parse_args()
most = max(cli.len + [sum(cli.ragged)])
args = build_parser().parse_args(["--load-format", "dummy", "--model-config", cli.model_config, "--batch-size",
                                  str(max(1, len(cli.ragged))),
                                  "--input-len", str(most), "--output-len", "8", "--enable-piecewise-cuda-graph",
                                  "--piecewise-cuda-graph-max-tokens", str(most)])
t0 = time.monotonic()
runner, pool, alloc = build_runner(args, model_dir(args))
print(f"runner with piecewise graphs up to {most} tokens built in {time.monotonic() - t0:.1f} s (their capture "
      f"{runner.pieces.capture_s:.1f} s, their pool {runner.pieces.pool_bytes / 2**30:.2f} GiB); "
      f"GPU memory allocated {torch.cuda.memory_allocated() / 2**30:.2f} GiB, "
      f"reserved {torch.cuda.memory_reserved() / 2**30:.2f} GiB")
pieces = runner.pieces
ceil = Ceilings.measure()
rate = ceil["fp8_flops"] if runner.cfg.is_fp8 else ceil["bf16_flops"]


def batch_of(lens: list[int]) -> tuple[Batch, list]:
    reqs, all_slots = [], []
    for i, n in enumerate(lens):
        req = Req(f"p{i}", torch.randint(2, runner.cfg.vocab_size, (n,)).tolist(),
                  SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True), seed=i)
        slots = alloc.alloc(n)
        req.req_pool_idx = pool.alloc()
        pool.write(req.req_pool_idx, 0, slots)
        reqs.append(req)
        all_slots.append(slots)
    slots = torch.cat(all_slots)
    return Batch(ForwardMode.EXTEND, reqs, [t for r in reqs for t in r.input_ids], slots, [0] * len(lens),
                 lens, [True] * len(lens)), all_slots


def logits(batch: Batch) -> torch.Tensor:
    """All rows' logits of the batch (the eager or the piecewise forward: whatever runner.pieces is)."""
    ctx = build_context(ForwardMode.EXTEND, req_pool_idx=[r.req_pool_idx for r in batch.reqs],
                        prefix_lens=batch.prefix_lens, extend_lens=batch.extend_lens, out_slots=batch.out_slots,
                        req_to_token=runner.req_to_token, kv_pool=runner.pool, attn_backend=runner.attn_backend,
                        device=runner.device, last_token_logits=True)
    ids = torch.tensor(batch.input_ids, dtype=torch.int64, device=runner.device)
    return runner._forward_model(ids, ctx).logits


cases = [[n] for n in cli.len] + ([cli.ragged] if cli.ragged else [])
for lens in cases:
    batch, slots = batch_of(lens)
    tokens = sum(lens)
    flops = sum(prefill_flops(runner.cfg, n) for n in lens)
    runner.pieces = None
    want = logits(batch)
    runner.pieces = pieces
    got = logits(batch)
    diff = (got - want).abs().max().item()
    same = (got.argmax(-1) == want.argmax(-1)).float().mean().item()
    times = {"eager": [], "piecewise": []}
    for rnd in range(8):
        for name in times:
            runner.pieces = pieces if name == "piecewise" else None
            wall_gpu = wall_and_gpu_s(lambda: runner.forward(batch))
            if rnd:                                   # the first round warms both
                times[name].append(wall_gpu)
    runner.pieces = pieces
    print(f"prefill {'+'.join(map(str, lens))} = {tokens} tokens (padded to {pieces._size(tokens)}): piecewise vs "
          f"eager logits max |diff| {diff:.3g}, same argmax on {same:.0%} of rows")
    for name, ts in times.items():
        wall = statistics.median(w for w, _ in ts)
        gpu = statistics.median(g for _, g in ts)
        print(f"  {name:>9}: wall {wall * 1e3:7.2f} ms ({flops / wall / rate:4.0%} of the tensor-core rate), "
              f"GPU alone {gpu * 1e3:7.2f} ms ({flops / gpu / rate:4.0%})")
    for r, s in zip(batch.reqs, slots):
        alloc.free(s)
        pool.free(r.req_pool_idx)
print(f"piecewise runs: {pieces.runs}; tensor-core rate measured {rate / 1e12:.0f} TFLOP/s")
