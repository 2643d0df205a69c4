"""The prefill's causal self-attention (the new tokens' part of `mla_prefill`): our Triton flash kernel beside torch's
scaled-dot-product attention backends (cuDNN, flash, efficient), at DeepSeek's dims (q/k 128 + 64 rope, v 128).

Each row: us per call (median of CUDA-event timed calls, L2 flushed), TFLOP/s of the causal work, and the error of out
and lse against `flash_attn_varlen_ref` (fp32, the first 8 heads). The torch backends need one k of [T, H, 192]:
"+ cat" times the concatenation of k_nope and the shared k_pe with the call (what the model would pay); "alone" times
the call only ("+ cat": `join_k`; torch.cat's time is printed apart).
A backend that refuses the shape prints its one-line error."""
import argparse
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from mlaserve.bench.timing import time_cuda
from mlaserve.kernels.mla_prefill import _bhsd as bhsd, _flash_attn, flash_attn_varlen_ref, join_k

ap = argparse.ArgumentParser()
ap.add_argument("--heads", type=int, nargs="+", default=[128, 16])
ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 8192, 16384])
ap.add_argument("--seed", type=int, default=None)
a = ap.parse_args()
seed = a.seed if a.seed is not None else torch.seed() % 2**31
torch.manual_seed(seed)
print(f"seed {seed}; torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}")
DN, DR, DV = 128, 64, 128
scale = 1 / math.sqrt(DN + DR)


def inputs(t: int, h: int):
    q = torch.randn(t, h, DN + DR, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(t, h, DN + DV, device="cuda", dtype=torch.bfloat16)      # kv_b_proj's output: [k_nope | v]
    k_nope, v = kv[..., :DN], kv[..., DN:]
    k_pe = torch.randn(t, DR, device="cuda", dtype=torch.bfloat16)[:, None, :].expand(-1, h, -1)
    return q, k_nope, k_pe, v


def sdpa(backend):
    def run(q, k, v):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(bhsd(q), bhsd(k), bhsd(v), is_causal=True, scale=scale)
    return run


def cudnn_lse(q, k, v):
    out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(bhsd(q), bhsd(k), bhsd(v), None, True, 0.0, True,
                                                                   False, scale=scale)[:2]
    return out, lse


def err(x, ref):                             # x: [T, H, ...] of every head, ref: of the first heads
    x = x[:, :ref.shape[1]]
    return ((x.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


print("| H | T | path | us alone | us + cat | TFLOP/s (+ cat) | out err | lse err |")
print("|---|---|---|---|---|---|---|---|")
for h in a.heads:
    for t in a.tokens:
        q, k_nope, k_pe, v = inputs(t, h)
        flops = 2 * h * (DN + DR + DV) * t * (t + 1) / 2
        cu = torch.tensor([0, t], dtype=torch.int32)
        k = join_k(k_nope, k_pe)
        hr = min(h, 8)                       # the reference's [H, T, T] fp32 scores: its first 8 heads only
        ref_out, ref_lse = flash_attn_varlen_ref(q[:, :hr].float(), k[:, :hr].float(), v[:, :hr].float(), cu, cu,
                                                 scale, True)
        ours = lambda: _flash_attn(q, k_nope, k_pe, v, (t,), (t,), scale, True, q.dtype)
        o, l = ours()
        us = time_cuda(ours, iters=20) * 1000
        print(f"| {h} | {t} | triton flash (ours) | {us:.0f} | - | {flops / us / 1e6:.0f} | {err(o, ref_out):.1e} | "
              f"{err(l, ref_lse):.1e} |")
        paths = [("sdpa cudnn", sdpa(SDPBackend.CUDNN_ATTENTION)), ("sdpa flash", sdpa(SDPBackend.FLASH_ATTENTION)),
                 ("sdpa efficient", sdpa(SDPBackend.EFFICIENT_ATTENTION)), ("cudnn op + lse", cudnn_lse)]
        for name, fn in paths:
            try:
                res = fn(q, k, v)
            except RuntimeError as exc:
                print(f"| {h} | {t} | {name} | refused: {str(exc).splitlines()[0][:120]} | | | | |")
                continue
            o, l = res if isinstance(res, tuple) else (res, None)
            o = o.transpose(1, 2)[0]                                           # [T, H, Dv]
            l_err = f"{err(l.reshape(h, t).transpose(0, 1), ref_lse):.1e}" if l is not None else "-"
            alone = time_cuda(lambda: fn(q, k, v), iters=20) * 1000
            both = time_cuda(lambda: fn(q, join_k(k_nope, k_pe), v), iters=20) * 1000
            print(f"| {h} | {t} | {name} | {alone:.0f} | {both:.0f} | {flops / alone / 1e6:.0f} "
                  f"({flops / both / 1e6:.0f}) | {err(o, ref_out):.1e} | {l_err} |")
        cat_us = time_cuda(lambda: torch.cat([k_nope, k_pe], dim=-1), iters=20) * 1000
        join_us = time_cuda(lambda: join_k(k_nope, k_pe), iters=20) * 1000
        print(f"k of [{t}, {h}, 192]: torch.cat {cat_us:.0f} us, join_k {join_us:.0f} us, bytes' time at 3 TB/s "
              f"{t * h * (128 + 192) * 2 / 3e6:.0f} us")
        # cuDNN's output layout: does it honour a [T, H, D] (BSHD) view, i.e. is its out strided like q?
        try:
            o = cudnn_lse(q, k, v)[0]
            print(f"cudnn out shape {tuple(o.shape)} strides {o.stride()}")
        except RuntimeError:
            pass
        del q, k_nope, k_pe, v, k
        torch.cuda.empty_cache()
