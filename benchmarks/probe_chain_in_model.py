"""Where the one-launch MLA chain's time goes inside the model's decode graph (issue 15), not alone.

Runs `bench one-batch` in this process with the chain on (MLASERVE_MLA_CHAIN=1) and every chain call given timer
stamps (`kernels/mla_chain.py`'s TIMING: call i of a forward writes row i % --layers), then prints the stamps of the
last replayed decode step in `benchmarks/probe_mla_chain.py --stamps`'s table. Its "gap" is here the rest of a layer
(o_proj, router, MoE, the next projections) between two chain calls.
Usage: python benchmarks/probe_chain_in_model.py [--layers 27] [--block-n N] -- BENCH ONE-BATCH ARGS (one bs)
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe_mla_chain import STAMP_HEADER, stamp_row  # noqa: E402  (this folder's probe)

from mlaserve.attention import triton as backend  # noqa: E402
from mlaserve.bench.one_batch import main as one_batch  # noqa: E402
from mlaserve.kernels import mla_chain  # noqa: E402


def main() -> int:
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=27, help="chain calls a forward (V2-Lite: 27)")
    ap.add_argument("--block-n", type=int, default=None, help="mla_chain.CHAIN_BLOCK_N")
    args = ap.parse_args(argv[:cut])
    os.environ["MLASERVE_MLA_CHAIN"] = "1"
    mla_chain.CHAIN_BLOCK_N = args.block_n
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    times = torch.zeros(args.layers, sms, mla_chain.STAMPS.value, dtype=torch.int64, device="cuda")
    state = {"calls": 0}
    chain = backend.mla_decode_chain

    def stamped(*a, **kw):
        i = state["calls"] % args.layers
        state["calls"] += 1
        state["splits"], state["seq_lens"] = kw["num_kv_splits"], a[12]
        return chain(*a, **kw, times=times[i])

    backend.mla_decode_chain = stamped
    rc = one_batch(argv[cut + 1:])
    torch.cuda.synchronize()
    if "splits" not in state:
        print("the chain never ran (MLASERVE_MLA_CHAIN, one token, chain_fits)")
        return 1
    tiles = mla_chain.CHAIN_BLOCK_N or "the default"
    print(f"in the model, tiles of {tiles} tokens, {mla_chain.NUM_WARPS} warps, {state['calls']} chain calls; "
          "the last step:")
    print(STAMP_HEADER)
    print(stamp_row(times.cpu(), int(state["seq_lens"][0]), state["splits"]))
    return rc


if __name__ == "__main__":
    sys.exit(main())
