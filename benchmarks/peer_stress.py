"""The peer all-reduce kernels in a decode's order, many times over, on two ranks: which sequence stops, if any.

The V2-Lite tp 2 one-batch on two H200s did not finish bs 64 with the in-kernel sums on (bs 1 and 16 did;
`benchmarks/results/tp-h200x2.md`). This replays, without the model, what such a run asks of the peer buffers,
phase by phase, and prints each phase's time as it ends:

    bs1      per layer: the router's launch summing this rank's share over the ranks (`moe_route_norm`'s
             all_reduce), the one-token fused MoE summing its output in its combine (`fused_moe_norm`'s), and a
             dense layer's push all-reduce + norm; with --sums 0, the push all-reduce before each instead
    bs1-graph  the same layers captured in a CUDA graph, replayed (GPU only)
    bs16, bs64 per layer: the pull kernel's all-reduce + norm and all-reduce of [bs, hidden]
    then all of it again, in the same order (bs 1 after bs 64 too)

Every rank checks its sums against NCCL's (gloo's on the CPU) once per phase, and both ranks' results must agree
bit for bit. A phase past --phase-timeout prints every thread's stack of that rank (faulthandler) and the run
ends with one line naming the rank; the kernels a phase left spinning are then killed with the rank.

    python benchmarks/peer_stress.py                       # two GPUs, V2-Lite's shapes (hidden 2048, 64 x 704)
    python benchmarks/peer_stress.py --sums 0              # the same with the push kernel instead of in-kernel sums
    TRITON_INTERPRET=1 python benchmarks/peer_stress.py --device cpu --hidden 64 --experts 8 --inter 32 \\
        --layers 2 --steps 2                               # the plumbing, on the CPU
"""
from __future__ import annotations

import argparse
import faulthandler
import os
import sys
import time

import torch
import torch.distributed as dist

from mlaserve.distributed import spawn_ranks

EPS = 1e-6


def _rank(group, args: argparse.Namespace) -> dict:
    from mlaserve.kernels.fused_moe import fused_moe, fused_moe_norm
    from mlaserve.kernels.moe_topk import moe_route_norm

    tp, rank = group.tp, group.info.rank
    peer = tp.peer
    assert peer is not None, "the peer buffers did not come up (GPUs without peer access?)"
    cuda = args.device == "cuda"
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if cuda else torch.float32
    h, e, inter, k = args.hidden, args.experts, args.inter, args.top_k
    shared, mine = torch.Generator().manual_seed(0), torch.Generator().manual_seed(1 + rank)
    gate = (torch.randn(e, h, generator=shared) / h ** 0.5).to(dev, dtype)
    w13 = (torch.randn(e, 2 * inter, h, generator=mine) / h ** 0.5).to(dev, dtype)
    w2 = (torch.randn(e, h, inter, generator=mine) / inter ** 0.5).to(dev, dtype)
    nw = (torch.rand(h, generator=shared) + 0.5).to(dev, dtype)
    route_sync = torch.zeros(128, dtype=torch.int32, device=dev)
    combine_sync = torch.zeros(h // 16 + 1, dtype=torch.int32, device=dev)
    routing = dict(topk_method="greedy", scoring_func="softmax")
    ll = peer.ll_group

    on_dev = torch.Generator(device=dev).manual_seed(100 + rank)

    def share(t: int) -> torch.Tensor:
        # NOTE: drawn on the device: drawn on the host, the bs-64 phases took 59-80 s (both ranks' stacks in
        # randn; two H200s, 2026-11-27) and that time, not the kernels', was what the phase timeout caught
        return torch.randn(t, h, generator=on_dev, device=dev, dtype=dtype)

    def layer_bs1(x: torch.Tensor, res: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One MoE layer and one dense layer's all-reduces at one token, as the model runs them."""
        if args.sums:
            w, ids, normed, res = moe_route_norm(x, res, nw, EPS, gate, k, sync=route_sync, all_reduce=ll, **routing)
            out, res = fused_moe_norm(normed, w13, w2, w, ids, res, nw, EPS, sync=combine_sync, all_reduce=ll)
        else:
            x = peer.all_reduce(x)
            w, ids, normed, res = moe_route_norm(x, res, nw, EPS, gate, k, sync=route_sync, **routing)
            part = fused_moe(normed, w13, w2, w, ids, sync=combine_sync)
            out, res = peer.all_reduce_add_norm(part, res, nw, EPS)
        dense = out * 0.5                                          # stands in for this rank's dense-MLP share
        return peer.all_reduce_add_norm(dense, res.clone(), nw, EPS)

    def check(x: torch.Tensor, what: str) -> None:
        """The peer sum of x against NCCL's (gloo's), and against the other rank's result."""
        got = x.clone()
        tp.all_reduce(got)
        want = x.clone()
        dist.all_reduce(want, group=tp.group)
        assert torch.equal(got, want) or torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2), \
            f"rank {rank} {what}: the peer sum differs from the library's"
        both = [torch.empty_like(got) for _ in range(2)]
        dist.all_gather(both, got, group=tp.group)
        assert torch.equal(both[0], both[1]), f"rank {rank} {what}: the ranks' sums differ"

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def phase(name: str, fn) -> None:
        faulthandler.dump_traceback_later(args.phase_timeout, exit=False)
        t0 = time.perf_counter()
        fn()
        sync()
        faulthandler.cancel_dump_traceback_later()
        dist.barrier(group=group.cpu_group)
        times.append((name, time.perf_counter() - t0))
        if rank == 0:
            print(f"{name}: {times[-1][1]:.2f} s", flush=True)

    def bs1() -> None:
        x, res = share(1), share(1)
        for _ in range(args.steps):
            for _ in range(args.layers):
                x, res = layer_bs1(x, res)
        check(share(1), "bs 1")

    def bs1_graph() -> None:
        x, res = share(1), share(1)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            layer_bs1(x, res)                                      # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            a, b = x, res
            for _ in range(args.layers):
                a, b = layer_bs1(a, b)
        for _ in range(args.steps):
            graph.replay()
        check(share(1), "bs 1 graph")

    def pull(bs: int):
        def run() -> None:
            for _ in range(args.steps):
                for _ in range(args.layers):
                    x, res = share(bs), share(bs)
                    peer.all_reduce_add_norm(x, res, nw, EPS)
                    tp.all_reduce(share(bs))
            check(share(bs), f"bs {bs}")
        return run

    times: list[tuple[str, float]] = []
    plan = [("bs1", bs1)] + ([("bs1-graph", bs1_graph)] if cuda else []) + [("bs16", pull(16)), ("bs64", pull(64))]
    for rnd in range(args.rounds):
        for name, fn in plan:
            phase(f"round {rnd + 1} {name}", fn)
    return {"times": times, "pull_epochs": peer.peers.epochs.cpu(), "push_epochs": peer.ll.epochs.cpu()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--inter", type=int, default=704, help="each rank's share of an expert's intermediate size")
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--layers", type=int, default=26)
    ap.add_argument("--steps", type=int, default=64, help="decode steps per phase")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--sums", type=int, choices=(0, 1), default=1, help="in-kernel sums (1) or the push kernel (0)")
    ap.add_argument("--phase-timeout", type=float, default=120.0)
    args = ap.parse_args(argv)
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        print("error: needs two GPUs (or --device cpu with TRITON_INTERPRET=1)", file=sys.stderr)
        return 2
    for var, value in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                       ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(var, value)                           # never NVLink multicast (the ranks inherit it)
    limit = args.phase_timeout * 4 * args.rounds + 300
    ranks = spawn_ranks(_rank, 2, args, device=args.device, peer_all_reduce=True, timeout=limit)
    a, b = ranks
    assert torch.equal(a["pull_epochs"], b["pull_epochs"]) and torch.equal(a["push_epochs"], b["push_epochs"]), \
        "the ranks' epoch counters differ"
    print(f"ok: every phase finished on both ranks, sums {'in kernels' if args.sums else 'by the push kernel'}; "
          f"epoch counters equal")
    return 0


if __name__ == "__main__":
    sys.exit(main())
