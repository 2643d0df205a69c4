"""`mlaserve bench offline`: throughput over many random prompts through the offline Engine (the same
scheduler process and tokenizer manager as the server), all submitted at once.

    mlaserve bench offline --model-path DIR --num-prompts 200 --random-input-len 256 --random-output-len 128
"""
from __future__ import annotations

import argparse
import json
import random
import time

from mlaserve.config import ServerConfig, add_config_args


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mlaserve bench offline", description=__doc__.split("\n")[0])
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--random-input-len", type=int, default=256)
    ap.add_argument("--random-output-len", type=int, default=128)
    ap.add_argument("--random-range-ratio", type=float, default=1.0, help="lengths uniform in [ratio * len, len]")
    ap.add_argument("--bench-seed", type=int, default=1)
    ap.add_argument("--output-file", help="append one JSON line with the results")
    add_config_args(ap)
    args = ap.parse_args(argv)
    from mlaserve.config import config_from_args
    from mlaserve.server.engine import Engine

    server: ServerConfig = config_from_args(args)
    rng = random.Random(args.bench_seed)

    def length(n: int) -> int:
        return rng.randint(max(1, int(n * args.random_range_ratio)), n)

    with Engine(**server.flat()) as engine:
        vocab = engine.handle.info["vocab_size"]
        prompts = [[rng.randrange(16, min(vocab, 4096)) for _ in range(length(args.random_input_len))]
                   for _ in range(args.num_prompts)]
        params = [{"max_new_tokens": length(args.random_output_len), "ignore_eos": True, "temperature": 0}
                  for _ in prompts]
        engine.generate(input_ids=prompts[:1], sampling_params=params[:1])            # warm-up
        t0 = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=params)
        elapsed = time.perf_counter() - t0
    n_in = sum(len(p) for p in prompts)
    n_out = sum(o["meta_info"]["completion_tokens"] for o in outs)
    res = {"num_prompts": args.num_prompts, "elapsed_s": elapsed, "request_throughput": args.num_prompts / elapsed,
           "input_tokens": n_in, "output_tokens": n_out, "output_throughput": n_out / elapsed,
           "total_throughput": (n_in + n_out) / elapsed, "input_len": args.random_input_len,
           "output_len": args.random_output_len, "model_path": server.load.model_path}
    print(f"offline: {args.num_prompts} prompts in {elapsed:.2f} s: {res['request_throughput']:.2f} req/s, "
          f"output {res['output_throughput']:.0f} tok/s, total {res['total_throughput']:.0f} tok/s")
    if args.output_file:
        with open(args.output_file, "a") as f:
            f.write(json.dumps(res) + "\n")
    return 0
