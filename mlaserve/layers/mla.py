"""Multi-head Latent Attention (DeepSeek-V2 sec. 2.1), both forms over the paged latent KV cache.

Legend: `T` tokens, `H` local heads (num_attention_heads / tp), `L` kv_lora_rank, `R` qk_rope_head_dim,
`Dn` qk_nope_head_dim, `Dv` v_head_dim. Under tensor parallelism each rank holds H heads (q_b_proj / q_proj and
kv_b_proj column-parallel, o_proj row-parallel: the caller all-reduces) and the whole latent cache (q_a / kv_a
replicated). Extend (prefill) runs the non-absorbed form: k_nope / v are expanded from the latent through
kv_b_proj. Decode runs the absorbed form: W_UK folds into the query (q_nope @ w_kc -> [T, H, L]) and W_UV after
attention (o_latent @ w_vc -> [T, H, Dv]), so attention reads the 576-wide latent rows.
"""
from __future__ import annotations

import torch

from mlaserve.attention.base import KVNew
from mlaserve.config import ModelConfig
from mlaserve.core import ForwardContext, ForwardMode, compile_opaque
from mlaserve.distributed import TensorParallel
from mlaserve.kernels.quant import block_dequant_ref
from mlaserve.layers.linear import SINGLE, Linear, MergedLinear
from mlaserve.layers.ops import Ops
from mlaserve.layers.rmsnorm import RMSNorm
from mlaserve.layers.rope import RotaryEmbedding


class MLAAttention(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding, *,
                 dtype: torch.dtype, device: torch.device | str, ops: Ops, absorb: bool = True,
                 dequant_fp8: bool = False, tp: TensorParallel = SINGLE):
        super().__init__()
        self.layer_id, self.rotary, self.absorb, self.ops = layer_id, rotary, absorb, ops
        heads = cfg.num_attention_heads
        self.h = tp.split(heads, "num_attention_heads")
        self.dn, self.r, self.dv, self.l = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        quant = None if dequant_fp8 else cfg.quant
        kw = dict(dtype=dtype, device=device, quant=quant, ops=ops)
        hid, qk = cfg.hidden_size, cfg.qk_head_dim
        cols, rows = dict(tp=tp, tp_dim=0), dict(tp=tp, tp_dim=1)           # split by heads
        self.q_lora = cfg.q_lora_rank is not None
        # q_a_proj (or q_proj) and kv_a_proj_with_mqa read the same x: one GEMM `qkv_a_proj` where the parts allow
        # (no bias; FP8: q's rows a whole number of 128-blocks), with q_proj's part split by heads under TP
        q_out = cfg.q_lora_rank if self.q_lora else heads * qk
        q_local = q_out if self.q_lora else self.h * qk
        self.q_out, self.qkv_a_proj = q_local, None
        if not cfg.attention_bias and MergedLinear.can_merge([q_local, self.l + self.r], quant):
            self.qkv_a_proj = MergedLinear(hid, [q_out, self.l + self.r], sharded=[not self.q_lora, False], tp=tp,
                                           **kw)
        elif self.q_lora:
            self.q_a_proj = Linear(hid, cfg.q_lora_rank, bias=cfg.attention_bias, **kw)
        else:
            self.q_proj = Linear(hid, heads * qk, **kw, **cols)
        if self.q_lora:
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, dtype, device, ops=ops)
            self.q_b_proj = Linear(cfg.q_lora_rank, heads * qk, **kw, **cols)
        if self.qkv_a_proj is None:
            self.kv_a_proj_with_mqa = Linear(hid, self.l + self.r, bias=cfg.attention_bias, **kw)
        self.kv_a_layernorm = RMSNorm(self.l, cfg.rms_norm_eps, dtype, device, ops=ops)
        self.kv_b_proj = Linear(self.l, heads * (self.dn + self.dv), **kw, **cols)
        self.o_proj = Linear(heads * self.dv, hid, bias=cfg.attention_bias, **kw, **rows)   # partial sums
        # Absorbed weights, derived from kv_b_proj after loading (models/weights.py).
        self.register_buffer("w_kc", torch.empty(self.h, self.dn, self.l, dtype=dtype, device=device), persistent=False)
        self.register_buffer("w_vc", torch.empty(self.h, self.dv, self.l, dtype=dtype, device=device), persistent=False)

    def post_load(self) -> None:
        """Derive w_kc / w_vc from kv_b_proj (dequantised first when FP8)."""
        lin = self.kv_b_proj
        w = lin.weight.float() if lin.quant is None else \
            block_dequant_ref(lin.weight, lin.weight_scale_inv, lin.quant.block, torch.float32)
        self.set_absorbed(w.to(self.w_kc.dtype))

    def set_absorbed(self, kv_b: torch.Tensor) -> None:
        """kv_b: dequantised kv_b_proj weight [H * (Dn + Dv), L] -> w_kc [H, Dn, L], w_vc [H, Dv, L]."""
        w = kv_b.view(self.h, self.dn + self.dv, self.l)
        self.w_kc.copy_(w[:, : self.dn])
        self.w_vc.copy_(w[:, self.dn:])

    def expand_kv(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # latent: [n, L] -> k_nope [n, H, Dn], v [n, H, Dv]
        kv = self.kv_b_proj(latent).view(-1, self.h, self.dn + self.dv)
        return kv[..., : self.dn], kv[..., self.dn:]

    def qkv_a_from_norm(self, x: torch.Tensor, residual: torch.Tensor | None,
                        norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(qkv_a_proj(norm(x [+ residual])), the residual stream: x, or x + residual), the norm's kernel
        quantising for the FP8 GEMM; None where that GEMM takes no input quantised ahead (`Linear.prequant`)."""
        plan = None if self.qkv_a_proj is None else self.qkv_a_proj.prequant(x)
        if plan is None:
            return None
        qkv_a, res = norm.quantized_into(self.qkv_a_proj, x, residual, plan)
        return qkv_a, x if residual is None else res

    def forward(self, positions: torch.Tensor, x: torch.Tensor | None, ctx: ForwardContext,
                qkv_a: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, h] normed -> this rank's share of the attention output [T, h]; or qkv_a, qkv_a_proj's output
        [T, q_out + L + R] (`qkv_a_from_norm`), in x's place."""
        if qkv_a is None and self.qkv_a_proj is not None:
            qkv_a = self.qkv_a_proj(x)
        if qkv_a is not None:
            q, latent = qkv_a.split([self.q_out, self.l + self.r], dim=-1)   # views of one GEMM
        else:
            q, latent = (self.q_a_proj if self.q_lora else self.q_proj)(x), self.kv_a_proj_with_mqa(x)
        t = q.shape[0]
        q = self.q_a_layernorm.into(self.q_b_proj, q)[0] if self.q_lora else q
        q = q.view(t, self.h, self.dn + self.r)                               # [T, H, Dn + R]
        # latent: [T, L + R]
        kv_c = latent[:, : self.l]                                            # [T, L], normalised in place below
        # kv_a_layernorm on kv_c, rotate q_pe and k_pe, all in place, and write the [kv_c, k_pe] rows to the cache
        # (one kernel on Triton)
        pool, norm = ctx.kv_pool, self.kv_a_layernorm
        rope = (q[..., self.dn:], latent[:, self.l:], kv_c, positions, self.rotary.cos_sin_cache,
                pool.kv_buffer(self.layer_id), ctx.out_slots)
        rope_kw = dict(kv_scale=pool.kv_scale, norm_weight=norm.weight, eps=norm.eps)
        if ctx.mode is ForwardMode.DECODE and self.absorb and ctx.parts is None:
            # absorbed decode: one launch for the whole chain where the backend has it (one token), else W_UK's
            # per-head GEMM rides in the rope's launch (it reads q's other columns)
            o = _decode_chain(ctx.attn_backend, self.layer_id, q[..., : self.dn], self.w_kc, self.w_vc, rope,
                              rope_kw, ctx) if self.ops.name == "triton" else None
            if o is None:
                q_lat = self.ops.rope_head_gemm(q[..., : self.dn], self.w_kc, *rope, **rope_kw)     # [T, H, L]
                o = self._decode_absorbed(q_lat, q, ctx)
            return self.o_proj(o.reshape(t, self.h * self.dv))
        self.ops.mla_rope_kv_store(*rope, **rope_kw)
        k_pe = latent[:, self.l:]                                             # [T, R] (roped)
        # the new tokens' k_nope / v (kv_b_proj) here where the backend takes them: inside a piecewise graph's piece
        kv_new = self.expand_kv(kv_c) if ctx.attn_backend.takes_new_kv and ctx.mode is ForwardMode.EXTEND else None
        if ctx.splitter is not None:                    # piecewise graphs: the attention runs between two pieces
            o = ctx.splitter(self, q, kv_c, k_pe, kv_new)
        else:
            o = self.attend_extend(q, kv_c, k_pe, kv_new, ctx)
        return self.o_proj(o.reshape(t, self.h * self.dv))

    def attend_extend(self, q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_new: KVNew | None,
                      ctx: ForwardContext) -> torch.Tensor:
        """The attention of a batch that is not a plain decode: q [T, H, Dn + R] (q_pe roped), kv_c [T, L] (normed),
        k_pe [T, R] (roped), their latent rows already in the cache; kv_new: their (k_nope [T, H, Dn], v [T, H, Dv])
        or None (the backend expands kv_c) -> o [T, H, Dv]."""
        if ctx.parts is not None and self.absorb:       # a mixed batch: its prompts non-absorbed, its decodes absorbed
            n = q.shape[0] - ctx.decode_tokens
            (ext, dec), a, b = ctx.parts, slice(None, n), slice(n, None)
            kv_a = None if kv_new is None else (kv_new[0][a], kv_new[1][a])
            return torch.cat([self._attend(q[a], kv_c[a], k_pe[a], ext, kv_a),
                              self._attend(q[b], kv_c[b], k_pe[b], dec)])
        return self._attend(q, kv_c, k_pe, ctx, kv_new)

    def _attend(self, q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, ctx: ForwardContext,
                kv_new: KVNew | None = None) -> torch.Tensor:
        # q: [T, H, Dn + R] (q_pe roped), kv_c: [T, L], k_pe: [T, R] -> o: [T, H, Dv]
        if ctx.mode is ForwardMode.DECODE and self.absorb:
            return self.attend_absorbed(q, ctx)
        return _extend(ctx.attn_backend, self.layer_id, q, kv_c, k_pe, ctx, self.expand_kv, kv_new)   # [T, H, Dv]

    def attend_absorbed(self, q: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Absorbed attention of decode queries q [T, H, Dn + R] (q_pe roped), W_UK applied here -> o [T, H, Dv]."""
        q_lat = self.ops.head_gemm(q[..., : self.dn], self.w_kc)               # absorb W_UK: [T, H, L]
        return self._decode_absorbed(q_lat, q, ctx)

    def _decode_absorbed(self, q_lat: torch.Tensor, q: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        # q_lat: [T, H, L] (W_UK absorbed), q: [T, H, Dn + R] (q_pe roped) -> o: [T, H, Dv]
        o_lat = _decode(ctx.attn_backend, self.layer_id, q_lat, q[..., self.dn:], ctx)   # [T, H, L]
        return self.ops.head_gemm(o_lat, self.w_vc, trans=True)                # apply W_UV: [T, H, Dv]


@compile_opaque
def _decode(backend, layer: int, q: torch.Tensor, q_pe: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
    return backend.decode(layer, q, q_pe, ctx)


@compile_opaque
def _decode_chain(backend, layer: int, q_nope, w_kc, w_vc, rope, rope_kw, ctx: ForwardContext) -> torch.Tensor | None:
    return backend.decode_chain(layer, q_nope, w_kc, w_vc, rope, rope_kw, ctx)


@compile_opaque
def _extend(backend, layer: int, q, kv_c, k_pe, ctx: ForwardContext, expand_kv, kv_new) -> torch.Tensor:
    return backend.extend(layer, q, kv_c, k_pe, ctx, expand_kv, kv_new)
