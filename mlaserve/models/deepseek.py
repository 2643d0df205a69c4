"""DeepSeek V2 / V2-Lite / V3 / R1 decoder and its NextN (MTP) layer, one file, switched by config.

Legend: `T` tokens in the batch, `h` hidden_size, `V` vocab_size. Under tensor parallelism (`tp`) every layer
holds its shard and each block all-reduces twice: after attention and after the MLP / MoE (DESIGN.md sec. 6).
Under data-parallel attention (`dp`) `tp` is the attention group (attention, dense MLP, embedding, lm_head), and
each MoE runs over all ranks on every group's tokens: gathered before it, each group's rows handed back after it.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch

from mlaserve.config import ModelConfig
from mlaserve.core import ForwardContext
from mlaserve.distributed import DPAttention, TensorParallel
from mlaserve.distributed.expert import ExpertParallel
from mlaserve.layers.embedding import LMHead, VocabEmbedding
from mlaserve.layers.linear import Linear
from mlaserve.layers.mla import MLAAttention
from mlaserve.layers.moe import MoE, DenseMLP
from mlaserve.layers.ops import Ops, get_ops
from mlaserve.layers.rmsnorm import RMSNorm
from mlaserve.layers.rope import RotaryEmbedding


class ModelOutput(NamedTuple):
    logits: torch.Tensor    # [n, V] fp32: rows of ctx.logits_indices (all T when None)
    hidden: torch.Tensor    # [T, h] final-normed hidden states (the MTP layer's input)


class DecoderLayer(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, rotary: RotaryEmbedding, *, dtype: torch.dtype,
                 device: torch.device | str, ops: Ops, absorb: bool, dequant_fp8: bool, tp: TensorParallel,
                 dp: DPAttention | None = None, ep: ExpertParallel | None = None,
                 dense_tp: TensorParallel | None = None, moe_all_to_all: bool = False):
        super().__init__()
        quant = None if dequant_fp8 else cfg.quant
        self.tp = tp
        self.mlp_tp = tp            # the group the MLP's partial outputs are summed over (reduce_out)
        self.self_attn = MLAAttention(cfg, layer_id, rotary, dtype=dtype, device=device, ops=ops, absorb=absorb,
                                      dequant_fp8=dequant_fp8, tp=tp)
        self.dp = dp if cfg.is_moe_layer(layer_id) else None        # dense layers stay within the attention group
        if cfg.is_moe_layer(layer_id):
            self.mlp = MoE(cfg, quant=quant, dtype=dtype, device=device, ops=ops, tp=dp.world if dp else tp, ep=ep,
                           all_to_all=moe_all_to_all and dp is not None)
        else:
            self.mlp_tp = tp if dense_tp is None else dense_tp         # --moe-dense-tp-size 1: whole on every rank
            self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size, quant=quant, dtype=dtype, device=device,
                                ops=ops, tp=self.mlp_tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, ops=ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, ops=ops)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                ctx: ForwardContext, next_norm: RMSNorm | None = None,
                normed: bool = False) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """Pre-norm block with the residual carried separately: returns (mlp output, residual stream, False), their
        sum being the block's output (the add is fused into the next norm). `normed`: x is already this block's
        normed input (the previous block ran the norm). Given the norm that follows (`next_norm`: the next
        block's input norm or the final one), a one-token MoE block may run it inside its experts' combine, and a
        tensor-parallel block inside its all-reduce (peer buffers), and return (next_norm(output + residual),
        output + residual, True)."""
        h, qkv_a = x, None
        if not normed:
            # the norm's kernel quantises for an FP8 qkv_a_proj where that GEMM would quantise in a pass of its own
            fused = self.self_attn.qkv_a_from_norm(x, residual, self.input_layernorm)
            if fused is not None:
                (qkv_a, residual), h = fused, None
            elif residual is None:
                residual, h = x, self.input_layernorm(x)
            else:
                h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(positions, h, ctx, qkv_a)                       # this rank's share of the heads' sum
        t = x.shape[0]
        if self.dp is None and isinstance(self.mlp, MoE) and self.mlp.takes_norm(t):
            # under tensor parallelism the router sums the attention output over the ranks itself, and a one-token
            # experts' combine its output ([t, hidden] too, over the same group), where the push all-reduce would
            # take the rows (the same bits)
            group = self.tp.push_group(h) if self.tp.size > 1 and self.mlp.sums_in_kernels() else None
            if group is None:
                h = self.tp.all_reduce(h)
            if next_norm is not None and self.mlp.takes_next_norm(t) and (self.tp.size == 1 or group is not None):
                h, residual = self.mlp.forward_normed(h, residual, self.post_attention_layernorm, next_norm, group,
                                                      group)           # one token: no padding row (no mask)
                return h, residual, True
            h, residual = self.mlp.forward_normed(h, residual, self.post_attention_layernorm,  # norm in the router
                                                  sum_in=group, row_mask=ctx.moe_row_mask)
            return self.reduce_out(h, residual, next_norm)
        if isinstance(self.mlp, DenseMLP) and not self.tp.fuses_norm(h):
            # the norm's kernel quantises for an FP8 gate_up_proj (where it would be quantised in a pass of its own)
            mlp, residual = self.mlp.forward_norm(self.tp.all_reduce(h), residual, self.post_attention_layernorm)
            return self.reduce_out(mlp, residual, next_norm)
        h, residual = self.reduce_norm(h, residual, self.post_attention_layernorm)
        if self.dp is not None:
            return self.dp_moe(h, ctx.global_num_tokens, ctx.moe_row_mask), residual, False
        mlp = self.mlp(h, ctx.moe_row_mask) if isinstance(self.mlp, MoE) else self.mlp(h)
        return self.reduce_out(mlp, residual, next_norm)                    # sum of the intermediate shares

    def reduce_norm(self, h: torch.Tensor, residual: torch.Tensor,
                    norm: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
        """norm(all_reduce(h), residual): one launch where the peer all-reduce takes h."""
        if self.tp.fuses_norm(h):
            return self.tp.all_reduce_add_norm(h, residual, norm.weight, norm.eps)
        return norm(self.tp.all_reduce(h), residual)

    def reduce_out(self, h: torch.Tensor, residual: torch.Tensor,
                   next_norm: RMSNorm | None) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """The block's output from this rank's share h of the MLP: (all_reduce(h), residual, False), or, where the
        peer all-reduce takes h and the next norm, (next_norm(sum + residual), sum + residual, True)."""
        tp = self.mlp_tp
        if next_norm is not None and tp.fuses_norm(h):
            return *tp.all_reduce_add_norm(h, residual, next_norm.weight, next_norm.eps), True
        return tp.all_reduce(h), residual, False

    def dp_moe(self, h: torch.Tensor, counts: list[int], row_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The MoE under DP attention: h [n, h] of this group -> all groups' [N, h] -> MoE -> this group's [n, h];
        or, with the all-to-all dispatch on (eager forwards), each row only to the ranks holding its experts.
        `row_mask` [N] (decode graphs): the gathered rows that are requests'; the others route to no expert."""
        if self.mlp.all_to_all_on:
            return self.mlp.forward_all_to_all(h)
        return self.dp.scatter(self.mlp(self.dp.gather(h, counts), row_mask), counts)


class DeepseekModel(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, **kw):
        super().__init__()
        dtype, device = kw["dtype"], kw["device"]
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, device, tp=kw["tp"])
        self.layers = torch.nn.ModuleList(DecoderLayer(cfg, i, rotary, **kw) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, ops=kw["ops"])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x, residual, normed = self.embed_tokens(input_ids), None, False     # [T, h]
        for i, layer in enumerate(self.layers):
            after = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            x, residual, normed = layer(positions, x, residual, ctx, after, normed)
        return x if normed else self.norm(x, residual)[0]


class SharedHead(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str, ops: Ops,
                 tp: TensorParallel):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, ops=ops)
        self.head = LMHead(cfg.vocab_size, cfg.hidden_size, dtype, device, tp=tp, ops=ops)


class NextNLayer(torch.nn.Module):
    """DeepSeek-V3 MTP module (V3 paper sec. 2.2), checkpoint layer index `num_hidden_layers`.

    draft_logits = head(norm(Decoder(eh_proj([enorm(embed(next_tokens)); hnorm(hidden)]))))
    with `hidden` the main model's final-normed hidden state at the same position. Shares `embed_tokens`.
    """

    def __init__(self, cfg: ModelConfig, embed: VocabEmbedding, rotary: RotaryEmbedding, **kw):
        super().__init__()
        dtype, device, ops = kw["dtype"], kw["device"], kw["ops"]
        self.embed = embed
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, ops=ops)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, ops=ops)
        self.eh_proj = Linear(2 * cfg.hidden_size, cfg.hidden_size, dtype=dtype, device=device, ops=ops)
        self.block = DecoderLayer(cfg, cfg.num_hidden_layers, rotary, **kw)
        self.shared_head = SharedHead(cfg, dtype, device, ops, kw["tp"])
        self.vocab_map: torch.Tensor | None = None     # restrict_vocab(): draft logits column -> token id

    def restrict_vocab(self, token_ids: torch.Tensor) -> None:
        """Draft over these tokens only (`--speculative-token-map`): the head keeps their rows, so each draft step
        reads V' x h of head weights instead of V x h; `to_vocab` maps the draft's picks back to token ids."""
        head = self.shared_head.head
        self.vocab_map = head.restrict(token_ids).to(head.weight.device)

    def to_vocab(self, picks: torch.Tensor) -> torch.Tensor:
        """Token ids of draft logits columns (argmax / topk indices)."""
        return picks if self.vocab_map is None else self.vocab_map[picks]

    def forward(self, next_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                ctx: ForwardContext) -> ModelOutput:
        x = self.eh_proj(torch.cat([self.enorm(self.embed(next_ids)), self.hnorm(hidden)], dim=-1))
        x, residual, normed = self.block(positions, x, None, ctx, self.shared_head.norm)
        x = x if normed else self.shared_head.norm(x, residual)[0]
        rows = x if ctx.logits_indices is None else x[ctx.logits_indices]
        return ModelOutput(self.shared_head.head(rows), x)

    @torch.no_grad()
    def forward_idle(self, global_num_tokens: list[int]) -> None:
        """The IDLE forward under DP attention: its MoE's gather and scatter with no tokens of this group."""
        if self.block.dp is not None:
            w = self.enorm.weight
            self.block.dp_moe(torch.empty(0, w.shape[0], dtype=w.dtype, device=w.device), global_num_tokens)


class DeepseekForCausalLM(torch.nn.Module):
    """The whole model. `kernels` picks every op's implementation once: "triton" (the GPU fast path) or
    "torch" (the PyTorch references, any device; `--attention-backend torch`). `absorb=False` runs decode
    non-absorbed too (`--disable-mla`); `dequant_fp8=True` keeps an FP8 checkpoint's weights as `dtype`;
    `load_mtp` builds the NextN layer; `tp` is this rank's tensor-parallel group (default: one process), its
    attention group under data-parallel attention (`dp`); `ep` its expert-parallel group (over every rank under
    data-parallel attention); `dense_tp` the group of the dense MLP layers (default `tp`; `TensorParallel()`:
    whole on every rank, --moe-dense-tp-size 1); `moe_all_to_all` the all-to-all dispatch of the MoE layers
    under DP attention + EP in eager forwards (`moe_gather` turns it off while graphs are captured)."""

    def __init__(self, cfg: ModelConfig, *, dtype: torch.dtype = torch.bfloat16,
                 device: torch.device | str = "cpu", kernels: str = "torch", absorb: bool = True,
                 dequant_fp8: bool = False, load_mtp: bool = False, max_pos: int | None = None,
                 tp: TensorParallel | None = None, dp: DPAttention | None = None,
                 ep: ExpertParallel | None = None, dense_tp: TensorParallel | None = None,
                 moe_all_to_all: bool = False):
        super().__init__()
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.tp, self.dp = tp or TensorParallel(), dp
        self.ops = get_ops(kernels)
        self.rotary = RotaryEmbedding(cfg, max_pos, device)
        kw = dict(dtype=dtype, device=device, ops=self.ops, absorb=absorb, dequant_fp8=dequant_fp8, tp=self.tp,
                  dp=dp, ep=ep, dense_tp=dense_tp, moe_all_to_all=moe_all_to_all)
        self.model = DeepseekModel(cfg, self.rotary, **kw)
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, dtype, device, tp=self.tp, ops=self.ops)
        self.mtp = None
        if load_mtp:
            if cfg.num_nextn_predict_layers < 1:
                raise ValueError("this checkpoint has no MTP layer (num_nextn_predict_layers = 0)")
            self.mtp = NextNLayer(cfg, self.model.embed_tokens, self.rotary, **kw)

    @property
    def num_local_heads(self) -> int:
        return self.cfg.num_attention_heads // self.tp.size

    @property
    def num_kv_layers(self) -> int:
        return self.cfg.num_hidden_layers + (1 if self.mtp is not None else 0)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> ModelOutput:
        return self.head(self.model(input_ids, positions, ctx), ctx)

    @contextmanager
    def moe_gather(self) -> Iterator[None]:
        """Every MoE layer dispatches by gather + scatter inside (CUDA-graph capture: the all-to-all's row counts
        need a host sync). Every rank captures the same graphs, so the ranks' collectives still pair up."""
        moes = [m for m in self.modules() if isinstance(m, MoE) and m.dispatcher is not None]
        for m in moes:
            m.all_to_all_on = False
        try:
            yield
        finally:
            for m in moes:
                m.all_to_all_on = True

    def head(self, hidden: torch.Tensor, ctx: ForwardContext) -> ModelOutput:
        """The logits of the final-normed hidden states [T, h] at ctx.logits_indices (all rows when None)."""
        rows = hidden if ctx.logits_indices is None else hidden[ctx.logits_indices]
        return ModelOutput(self.lm_head(rows), hidden)

    @torch.no_grad()
    def forward_idle(self, global_num_tokens: list[int]) -> None:
        """The IDLE forward of a DP-attention group without tokens while others have some: it takes part in every
        MoE's gather and scatter (all of its other collectives stay within its own, idle, group)."""
        x = torch.empty(0, self.cfg.hidden_size, dtype=self.dtype, device=self.device)    # [0, h]
        for layer in self.model.layers:
            if layer.dp is not None:
                layer.dp_moe(x, global_num_tokens)
