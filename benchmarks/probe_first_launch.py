"""Which Triton kernel variants a request launches for the first time in a server process (CPU, no GPU needed).

On a GPU each new variant (kernel x constexprs x argument dtypes x integer specialisation) is a JIT compile on
first use (loaded from Triton's disk cache when an earlier process compiled it). This drives the real scheduler
in-process under TRITON_INTERPRET=1 on a CPU-sized V3-shape block-FP8 checkpoint and prints, per request, the
variants no earlier request launched. The requests are what benchmarks/ablation.py sent for TPS@1: a short warm-up
of QUERY, then QUERY again (a radix hit of all but its last token: an extend of 1 token over a cached prefix), then
QUERY a third time.

    PYTHONPATH=$PWD python benchmarks/probe_first_launch.py [--disable-radix-cache] [--nextn] [--dtype bfloat16]

The key approximates Triton's cache key (constexpr values, tensor dtypes and 16-byte alignment, ints as 1 /
multiple of 16 / other, num_warps / num_stages); decode runs eagerly here (no CUDA graphs on the CPU), so the
warm-up's decode steps stand in for the graph capture, which on the GPU compiles the decode variants before any
request.
"""
from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")      # NOTE: before any triton.jit decorator runs

import argparse  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

import mlaserve  # noqa: E402
from mlaserve.config import ServerConfig  # noqa: E402
from mlaserve.core import SamplingParams  # noqa: E402
from mlaserve.ipc.messages import GenerateReqMsg  # noqa: E402
from mlaserve.scheduler.scheduler import Scheduler  # noqa: E402
from mlaserve.tokenizer import load_tokenizer  # noqa: E402
from mlaserve.tools.make_checkpoint import make_config, write_checkpoint  # noqa: E402

QUERY = "Write a Python function that returns the n-th Fibonacci number, with a docstring and a short test."
CONFIGS = Path(mlaserve.__file__).parent / "tools" / "configs"
SEEN: list[tuple] = []                                 # variant keys in launch order (first launches only)


def _int_class(v: int) -> str:
    return "1" if v == 1 else "d16" if v % 16 == 0 else "i"


def _arg_key(v) -> str:
    if isinstance(v, torch.Tensor):                  # Triton also specialises pointers on 16-byte alignment
        return str(v.dtype).removeprefix("torch.") + ("" if v.data_ptr() % 16 == 0 else "@unaligned")
    if isinstance(v, bool) or v is None:
        return repr(v)
    if isinstance(v, int):
        return _int_class(v)
    return type(v).__name__


def _nospec(fn: InterpretedFunction) -> set[str]:
    """The kernel's `do_not_specialize` names, read from its decorator (the interpreter drops the argument)."""
    import re
    m = re.search(r"do_not_specialize=\[([^\]]*)\]", inspect.getsource(fn.fn).split("def ", 1)[0])
    return set(re.findall(r"\"(\w+)\"", m.group(1))) if m else set()


def variant_key(fn: InterpretedFunction, args: tuple, kwargs: dict) -> tuple:
    """(kernel, its specialisation) as Triton would key its compile cache, approximately."""
    params = inspect.signature(fn.fn).parameters
    nospec = _nospec(fn)
    bound = dict(zip(fn.arg_names, args)) | {k: v for k, v in kwargs.items() if k in params}
    parts = []
    for name, v in bound.items():
        ann = params[name].annotation
        if "constexpr" in str(ann):
            parts.append(f"{name}={v}")
        elif name in nospec and isinstance(v, int):
            parts.append(f"{name}:int")
        else:
            parts.append(f"{name}:{_arg_key(v)}")
    extra = [f"{k}={v}" for k, v in sorted(kwargs.items()) if k not in params and k not in ("grid", "warmup")]
    return (fn.fn.__name__, *parts, *extra)


def install_hook() -> None:
    run = InterpretedFunction.run
    seen: set[tuple] = set()

    def traced(self, *args, grid, warmup, **kwargs):
        key = variant_key(self, args, kwargs)
        if key not in seen:
            seen.add(key)
            SEEN.append(key)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = traced


def checkpoint(root: Path) -> str:
    d = json.loads((CONFIGS / "deepseek-v3.json").read_text()) | {"first_k_dense_replace": 1}
    return str(write_checkpoint(make_config(d, num_layers=2, shrink=True, fp8=True), root / "m", progress=False))


def serve_one(sched: Scheduler, rid: str, ids: list[int], max_new: int) -> dict:
    p = SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=True)
    sched.add_request(GenerateReqMsg(rid, ids, p, seed=1))
    out = {"tokens": 0, "cached": 0}
    while sched.has_work:
        for o in sched.step():
            out["tokens"] += len(o.new_ids)
            out["cached"] = o.cached_tokens
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--disable-radix-cache", action="store_true")
    ap.add_argument("--nextn", action="store_true", help="--speculative-algorithm EAGLE (the MTP layer drafts)")
    ap.add_argument("--dtype", default="float32", help="activation dtype (the GPU runs bfloat16)")
    ap.add_argument("--new", type=int, nargs="+", default=[8, 16, 16], help="new tokens of each request, in order")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        path = checkpoint(Path(tmp))
        ids = load_tokenizer(path).encode(QUERY)
        spec = dict(speculative_algorithm="EAGLE", speculative_num_steps=3) if args.nextn else {}
        sched = Scheduler(ServerConfig.from_flat(
            model_path=path, device="cpu", dtype=args.dtype, max_total_tokens=4096, log_level="warning",
            attention_backend="triton", disable_radix_cache=args.disable_radix_cache, **spec), path)
        install_hook()
        print(f"prompt {len(ids)} tokens; radix {'off' if args.disable_radix_cache else 'on'}; "
              f"nextn {'on' if args.nextn else 'off'}; dtype {args.dtype}")
        for i, n in enumerate(args.new):
            before = len(SEEN)
            out = serve_one(sched, f"r{i}", ids, n)
            new = SEEN[before:]
            print(f"\nrequest {i + 1}: {out['tokens']} new tokens, {out['cached']} prompt tokens cached; "
                  f"{len(new)} kernel variants launched for the first time")
            for key in new:
                print("  " + key[0] + "(" + ", ".join(key[1:]) + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
