"""The absorbed decode's attention chain at one token: one launch (`kernels/mla_chain.py`) against the four launches
it replaces (`rope_head_gemm`, `mla_decode` with its reduce, W_UV's `head_gemm`), V2-Lite's shape, bf16, on a GPU.

One CUDA graph of `--layers` calls back to back (each layer its own weights and cache, as in a decode step), PDL on,
L2 flushed before each replay; us per layer call, median of the replays. Also the largest difference of the two
outputs. Usage: python benchmarks/probe_mla_chain.py [--ctx 256 4096] [--splits 128 64] [--stamps]

--stamps: instead, where the one launch's time goes. Every program of every layer call stamps eight points
(%globaltimer and %clock64: start, past the PDL wait, phase A done, phase B may start, B done, C may start, C done,
out); the table gives, median over the layer calls, us from the call's first program start, and each phase's work
inside a program from its clock (cycles at the clock rate the two timers give).
"""
from __future__ import annotations

import argparse

import torch

from mlaserve.bench.timing import time_cuda
from mlaserve.kernels import mla_chain
from mlaserve.kernels.mla_absorb import head_gemm, rope_head_gemm
from mlaserve.kernels.mla_decode import mla_decode, pick_config

H, DN, R, L, DV = 16, 128, 64, 512, 128


def _layer(ctx: int, seed: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev, bf = "cuda", torch.bfloat16
    slots = ctx + 8
    ang = torch.arange(ctx + 1, device=dev)[:, None].float() * torch.rand(R // 2, device=dev, generator=g)[None, :]
    return dict(q=torch.randn(1, H, DN + R, device=dev, generator=g).to(bf),
                w_kc=(torch.randn(H, DN, L, device=dev, generator=g) / DN ** 0.5).to(bf),
                w_vc=(torch.randn(H, DV, L, device=dev, generator=g) / L ** 0.5).to(bf),
                latent=torch.randn(1, L + R, device=dev, generator=g).to(bf),
                cos_sin=torch.cat([ang.cos(), ang.sin()], dim=1).contiguous(),
                cache=torch.randn(slots, L + R, device=dev, generator=g).to(bf),
                norm_w=torch.ones(L, device=dev, dtype=bf))


def _inputs(ctx: int) -> tuple:
    req_to_token = torch.arange(ctx + 8, device="cuda", dtype=torch.int32)[None, :].repeat(2, 1).contiguous()
    return (req_to_token, torch.tensor([1], dtype=torch.int32, device="cuda"),
            torch.tensor([ctx], dtype=torch.int32, device="cuda"), torch.tensor([ctx - 1], device="cuda"),
            torch.tensor([ctx - 1], device="cuda"))


def summarize(t: torch.Tensor, a_prog: int, c_prog: int, splits: int, used: int) -> tuple[list[str], float]:
    """The --stamps table cells from int64 stamps [calls, programs, STAMPS], and the SM clock in GHz."""
    import statistics

    # relative in int64 first: %globaltimer's ~1e18 ns would lose the ns in a double
    ns = (t[..., 0::2] - t[..., 0].min()).double()
    clk = (t[..., 1::2] - t[..., 1:2]).double()                                 # cycles from each start
    rate = ((clk[..., 7] - clk[..., 0]).sum() / (ns[..., 7] - ns[..., 0]).sum()).item()   # cycles per ns
    rows = []
    for i in range(t.shape[0]):
        g = (ns[i] - ns[i, :, 0].min()) / 1e3                                   # us from the first start
        c = clk[i] / rate / 1e3                                                  # us of this SM's clock
        nxt = (ns[i + 1, :, 1].min() - ns[i, :, 7].max()).item() / 1e3 if i + 1 < t.shape[0] else float("nan")
        rows.append([g[:, 1].min(), g[:, 1].max(), g[:a_prog, 2].max(), g[:splits, 3].min(),
                     g[:splits, 3].max(), g[:used, 4].max(), g[:c_prog, 5].min(), g[:c_prog, 5].max(),
                     g[:c_prog, 6].max(), g[:, 7].max(), nxt,
                     (c[:a_prog - 1, 8] - c[:a_prog - 1, 1]).median(), (c[:a_prog - 1, 2] - c[:a_prog - 1, 1]).median(),
                     c[a_prog - 1, 2] - c[a_prog - 1, 1],
                     (c[:used, 9] - c[:used, 3]).median(), (c[:used, 10] - c[:used, 9]).median(),
                     (c[:used, 4] - c[:used, 10]).median(),
                     (c[:c_prog, 11] - c[:c_prog, 5]).median(), (c[:c_prog, 6] - c[:c_prog, 11]).median()])
    med = [statistics.median(float(r[j]) for r in rows if r[j] == r[j]) for j in range(len(rows[0]))]
    cells = [f"{med[0]:.2f} / {med[1]:.2f}", f"{med[2]:.2f}", f"{med[3]:.2f} / {med[4]:.2f}", f"{med[5]:.2f}",
             f"{med[6]:.2f} / {med[7]:.2f}", *(f"{v:.2f}" for v in med[8:])]
    return cells, rate


STAMP_HEADER = ("| ctx | splits | used | waited (first / last) | A done | B starts (first / last) | B done | C starts "
                "(first / last) | C done | out | gap | A q | A work | rope | B q | B attend | B store | C merge | "
                "C W_UV |\n|" + "---|" * 19)


def stamp_row(t: torch.Tensor, ctx: int, splits: int) -> str:
    """One STAMP_HEADER row from the stamps [calls, >= programs, STAMPS] of V2-Lite-shaped chain calls at ctx cached
    tokens over splits splits."""
    bn = mla_chain.CHAIN_BLOCK_N or pick_config(H).block_n
    split_len = -(-(-(-ctx // splits)) // bn) * bn           # (as the kernel: equal runs of whole tiles)
    used = -(-ctx // split_len)
    programs = mla_chain.chain_programs(H, L, DV, 1, splits)
    cells, rate = summarize(t[:, :programs], H * L // mla_chain.BN_A + 1, H * DV // mla_chain.BN_C, splits, used)
    return f"| {ctx} | {splits} | {used} | " + " | ".join(cells) + f" |  (clock {rate:.3f} GHz)"


def stamps(args) -> None:
    print(f"{torch.cuda.get_device_name()}: {args.layers} layer calls a graph, H={H}, bf16; medians over the calls")
    print(f"block_n {mla_chain.CHAIN_BLOCK_N or pick_config(H).block_n}, {mla_chain.NUM_WARPS} warps. Points from "
          "the call's first start: waited, A done, B starts, B done, C starts, C done, out, and the gap to the next "
          "call's first wait; then inside a program: A's q arrives, A's work (to its release), the rope program's, "
          "B's q arrives, B attends, B stores + releases, C merges, C's W_UV + store")
    print(STAMP_HEADER)
    for ctx in args.ctx:
        layers = [_layer(ctx, 1000 + i) for i in range(args.layers)]
        req_to_token, pool_idx, seq_lens, positions, out_slots = _inputs(ctx)
        for splits in args.splits:
            programs = mla_chain.chain_programs(H, L, DV, 1, splits)
            times = torch.zeros(args.layers, programs, mla_chain.STAMPS.value, dtype=torch.int64, device="cuda")

            def one():
                for i, x in enumerate(layers):
                    mla_chain.mla_decode_chain(x["q"][..., :DN], x["w_kc"], x["w_vc"], x["q"][..., DN:],
                                               x["latent"][:, L:], x["latent"][:, :L], positions, x["cos_sin"],
                                               x["cache"], out_slots, req_to_token, pool_idx, seq_lens, 0.1,
                                               num_kv_splits=splits, norm_weight=x["norm_w"], eps=1e-6,
                                               times=times[i])
            time_cuda(one, iters=10)            # the last replay's stamps stay in `times`
            print(stamp_row(times.cpu(), ctx, splits))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", type=int, nargs="+", default=[256, 4096])
    ap.add_argument("--splits", type=int, nargs="+", default=[128, 64])
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--chunk-s", type=int, default=None, help="phase C's partials a step (mla_chain.CHUNK_S)")
    ap.add_argument("--stamps", action="store_true", help="where the one launch's time goes (see the docstring)")
    ap.add_argument("--block-n", type=int, default=None, help="cached tokens a tile (mla_chain.CHAIN_BLOCK_N)")
    ap.add_argument("--warps", type=int, default=None, help="mla_chain.NUM_WARPS")
    args = ap.parse_args()
    mla_chain.CHAIN_BLOCK_N = args.block_n
    mla_chain.NUM_WARPS = args.warps or mla_chain.NUM_WARPS
    if args.stamps:
        return stamps(args)
    if args.chunk_s:
        mla_chain.CHUNK_S = args.chunk_s
    print(f"{torch.cuda.get_device_name()}: {args.layers} layer calls a graph, H={H}, bf16, phase C merging "
          f"{mla_chain.CHUNK_S} partials a step, the chain's tiles {mla_chain.CHAIN_BLOCK_N or pick_config(H).block_n}"
          f" tokens, {mla_chain.NUM_WARPS} warps; us per layer call")
    print("| ctx | splits | four launches | one launch | speed-up | max diff |")
    print("|---|---|---|---|---|---|")
    for ctx in args.ctx:
        layers = [_layer(ctx, 1000 + i) for i in range(args.layers)]
        req_to_token = torch.arange(ctx + 8, device="cuda", dtype=torch.int32)[None, :].repeat(2, 1).contiguous()
        pool_idx = torch.tensor([1], dtype=torch.int32, device="cuda")
        seq_lens = torch.tensor([ctx], dtype=torch.int32, device="cuda")
        positions = torch.tensor([ctx - 1], device="cuda")
        out_slots = torch.tensor([ctx - 1], device="cuda")
        for splits in args.splits:
            def rope(x):
                return (x["q"][..., DN:], x["latent"][:, L:], x["latent"][:, :L], positions, x["cos_sin"], x["cache"],
                        out_slots)

            def four():
                outs = []
                for x in layers:
                    q_lat = rope_head_gemm(x["q"][..., :DN], x["w_kc"], *rope(x), norm_weight=x["norm_w"], eps=1e-6)
                    o = mla_decode(q_lat, x["cache"], req_to_token, pool_idx, seq_lens, 0.1, kv_lora_rank=L,
                                   num_kv_splits=splits, q_pe=x["q"][..., DN:])
                    outs.append(head_gemm(o, x["w_vc"], trans=True))
                return outs

            def one():
                return [mla_chain.mla_decode_chain(x["q"][..., :DN], x["w_kc"], x["w_vc"], *rope(x), req_to_token,
                                                   pool_idx, seq_lens, 0.1, num_kv_splits=splits,
                                                   norm_weight=x["norm_w"], eps=1e-6)
                        for x in layers]
            # NOTE: the rope rotates q_pe in place on every call: the two forms read the same (repeatedly rotated)
            # values only when compared right after one another from the same state, as below
            saved = [(x["q"].clone(), x["latent"].clone()) for x in layers]
            a = four()
            for x, (q, lat) in zip(layers, saved):
                x["q"].copy_(q)
                x["latent"].copy_(lat)
            b = one()
            diff = max((u.float() - v.float()).abs().max().item() for u, v in zip(a, b))
            t4 = time_cuda(four, iters=30) * 1e3 / args.layers
            t1 = time_cuda(one, iters=30) * 1e3 / args.layers
            print(f"| {ctx} | {splits} | {t4:.2f} | {t1:.2f} | {t4 / t1:.2f}x | {diff:.2e} |")


if __name__ == "__main__":
    main()
