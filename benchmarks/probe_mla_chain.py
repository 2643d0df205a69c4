"""The absorbed decode's attention chain at one token: one launch (`kernels/mla_chain.py`) against the four launches
it replaces (`rope_head_gemm`, `mla_decode` with its reduce, W_UV's `head_gemm`), V2-Lite's shape, bf16, on a GPU.

One CUDA graph of `--layers` calls back to back (each layer its own weights and cache, as in a decode step), PDL on,
L2 flushed before each replay; us per layer call, median of the replays. Also the largest difference of the two
outputs. Usage: python benchmarks/probe_mla_chain.py [--ctx 256 4096] [--splits 128 64]
"""
from __future__ import annotations

import argparse

import torch

from mlaserve.bench.timing import time_cuda
from mlaserve.kernels import mla_chain
from mlaserve.kernels.mla_absorb import head_gemm, rope_head_gemm
from mlaserve.kernels.mla_decode import mla_decode

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


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", type=int, nargs="+", default=[256, 4096])
    ap.add_argument("--splits", type=int, nargs="+", default=[128, 64])
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--chunk-s", type=int, default=None, help="phase C's partials a step (mla_chain.CHUNK_S)")
    args = ap.parse_args()
    if args.chunk_s:
        mla_chain.CHUNK_S = args.chunk_s
    print(f"{torch.cuda.get_device_name()}: {args.layers} layer calls a graph, H={H}, bf16, phase C merging "
          f"{mla_chain.CHUNK_S} partials a step; us per layer call")
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
