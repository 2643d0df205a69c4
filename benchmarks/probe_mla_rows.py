"""The bs-1 / short-context MLA decode at decode-graph conditions: the shipped kernel's configs (and its H=16 entry
before 2026-12-02: 4 warps) beside a one-head-a-program variant (CUDA-core dot products, no tensor cores), with and
without splits.

Each variant runs 27 times back to back in one CUDA graph (one per layer, each on its own cache and query, as the
decode graph does), launched with PDL where the kernels take it; us per layer, the split reduce included.
Usage: PYTHONPATH=$PWD python3 benchmarks/probe_mla_rows.py [--ctx 256 1024 4096] [--batch 1 4 16 64]
"""
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

import mlaserve.kernels.mla_decode as md
from mlaserve.bench.kernel_cases.mla_decode import KV_LORA_RANK, ROPE_DIM, SM_SCALE, make_inputs, rel_error
from mlaserve.kernels.pdl import pdl_enter, pdl_meta, pdl_release
from chain_timer import chain_us

L, R, H = KV_LORA_RANK, ROPE_DIM, 16
LAYERS = 27


@triton.jit(do_not_specialize=["num_splits"])
def _rows_kernel(Q, KV, ReqToToken, ReqPoolIdx, SeqLens, MidO, MidLse, Out, qk_scale, stride_qt, stride_qh,
                 stride_kv, stride_rtt, stride_ot, stride_oh, H, num_splits, L: tl.constexpr, R: tl.constexpr,
                 BLOCK_N: tl.constexpr, PDL: tl.constexpr):
    # one (request, head, split); scores and the weighted sum on CUDA cores: [BLOCK_N, L] tiles summed along L / N
    pdl_enter(PDL)
    h = tl.program_id(1)
    b, split, seq_len, pool_row, start, end = md.split_bounds(SeqLens, ReqPoolIdx, num_splits, BLOCK_N)
    offs_l = tl.arange(0, L)
    offs_r = tl.arange(0, R)
    q = tl.load(Q + b * stride_qt + h * stride_qh + offs_l).to(tl.float32)
    q_pe = tl.load(Q + b * stride_qt + h * stride_qh + L + offs_r).to(tl.float32)
    m_i = float("-inf")
    l_i = 0.0
    acc = tl.zeros([L], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        ok = pos < end
        slot = tl.load(ReqToToken + pool_row * stride_rtt + pos, mask=ok, other=0).to(tl.int64)
        row = KV + slot * stride_kv
        kv = tl.load(row[:, None] + offs_l[None, :], mask=ok[:, None], other=0.0).to(tl.float32)        # [BN, L]
        pe = tl.load(row[:, None] + L + offs_r[None, :], mask=ok[:, None], other=0.0).to(tl.float32)    # [BN, R]
        s = tl.sum(kv * q[None, :], axis=1) + tl.sum(pe * q_pe[None, :], axis=1)
        s = tl.where(ok, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        p = tl.exp2(s - m_new)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * kv, axis=0)
        m_i = m_new
    pdl_release(PDL)
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    if MidO is None:
        tl.store(Out + b * stride_ot + h * stride_oh + offs_l, (acc / l_safe).to(Out.dtype.element_ty))
    else:
        mid = (b * H + h) * num_splits + split
        if start < seq_len:
            tl.store(MidO + mid * L + offs_l, acc / l_safe)
        tl.store(MidLse + mid, tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf")))


_scratch: dict = {}          # (query tensor id, splits) -> the split partials' buffers


def rows_decode(inp: dict, out: torch.Tensor, splits: int, block_n: int, warps: int) -> None:
    q, kv = inp["q"], inp["kv_cache"]
    b = q.shape[0]
    mid_o = mid_lse = None
    if splits > 1:
        mid_o, mid_lse = _scratch.setdefault((id(q), splits), (torch.empty(b, H, splits, L, device=q.device),
                                                               torch.empty(b, H, splits, device=q.device)))
    _rows_kernel[(b, H, splits)](q, kv, inp["req_to_token"], inp["req_pool_idx"], inp["seq_lens"], mid_o, mid_lse, out,
                                 SM_SCALE * md.LOG2E, q.stride(0), q.stride(1), kv.stride(0),
                                 inp["req_to_token"].stride(0), out.stride(0), out.stride(1), H, splits, L=L, R=R,
                                 BLOCK_N=block_n, **pdl_meta(q.device), num_warps=warps)
    if splits > 1:
        md._reduce(mid_o, mid_lse, out, splits)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ctx", type=int, nargs="+", default=[256, 1024, 4096])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16, 64])
    args = ap.parse_args()
    torch.manual_seed(0)
    base = dict(md.CONFIGS)
    print(f"MLA decode, H={H}, {LAYERS} calls a graph, us a call (split reduce included); {torch.cuda.get_device_name()}")
    for batch in args.batch:
        for ctx in args.ctx:
            layers = [make_inputs(H, batch, ctx) for _ in range(LAYERS)]
            outs = [torch.empty(batch, H, L, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
            want = md.mla_decode_ref(**layers[0])
            graph_splits = md.choose_num_kv_splits(md.decode_programs(batch, H), 1 << 20)
            cells = []

            def run(name, fn):
                fn(layers[0], outs[0])
                err = rel_error(outs[0], want)
                us = chain_us([lambda i=i: fn(layers[i], outs[i]) for i in range(LAYERS)])
                cells.append(f"{name} {us:.2f}{'' if err < 2e-2 else f' ERR {err:.3f}'}")

            decode = lambda i, o: md.mla_decode(**i, num_kv_splits=graph_splits, out=o)    # noqa: E731
            run(f"shipped S={graph_splits}", decode)
            for bh, bn, w, st in ((16, 64, 4, 2), (16, 32, 4, 2), (64, 64, 4, 2), (64, 64, 8, 3)):
                md.CONFIGS = {**base, 16: md.MLADecodeConfig(bh, bn, w, st)}
                run(f"cfg({bh},{bn},{w},{st})", decode)
            md.CONFIGS = base
            for splits in (1, 2, 4, graph_splits):
                for bn, w in ((32, 4), (64, 4), (64, 8), (128, 8)):
                    run(f"rows S={splits} BN={bn} w={w}", lambda i, o: rows_decode(i, o, splits, bn, w))
            print(f"B={batch} ctx={ctx}: " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
