"""DeepSeek-V3 for training, in plain PyTorch (autograd, whole sequences, no KV cache), gpt-fast style.

The math is that of `models/deepseek.py`: MLA with q_lora and interleaved YaRN rope, dense-first layers, MoE
with shared experts and noaux_tc routing (sigmoid scores, `e_score_correction_bias` used for choosing only),
and the NextN (MTP) layer (DeepSeek-V3 sec. 2.2). Parameter names are the original checkpoint's, so
`checkpoint_state` only moves the MTP layer to index `num_hidden_layers`.

Legend: `B` sequences, `S` positions, `h` hidden_size, `H` heads, `Dn` qk_nope_head_dim, `R` qk_rope_head_dim,
`Dv` v_head_dim, `L` kv_lora_rank, `E` routed experts, `K` experts per token, `V` vocab_size.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from mlaserve.config import ModelConfig
from mlaserve.kernels.moe_topk import moe_topk_ref
from mlaserve.kernels.rope import rope_ref
from mlaserve.layers.rope import build_cos_sin_cache
from mlaserve.models.weights import checkpoint_specs

INIT_STD = 0.02


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


def linear(n_in: int, n_out: int) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=False)


class MLA(nn.Module):
    """Multi-head latent attention, non-absorbed (DeepSeek-V2 sec. 2.1): the latent is expanded per head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, H = cfg.hidden_size, cfg.num_attention_heads
        self.cfg, self.H = cfg, H
        self.dn, self.r, self.dv, self.l = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        self.q_a_proj = linear(h, cfg.q_lora_rank)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = linear(cfg.q_lora_rank, H * (self.dn + self.r))
        self.kv_a_proj_with_mqa = linear(h, self.l + self.r)
        self.kv_a_layernorm = RMSNorm(self.l, cfg.rms_norm_eps)
        self.kv_b_proj = linear(self.l, H * (self.dn + self.dv))
        self.o_proj = linear(H * self.dv, h)

    def forward(self, x: torch.Tensor, rope: RopeTable) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(b, s, self.H, self.dn + self.r)
        q_nope, q_pe = q.split([self.dn, self.r], dim=-1)                      # [B, S, H, Dn], [B, S, H, R]
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.l, self.r], dim=-1)  # [B, S, L], [B, S, R]
        kv = self.kv_b_proj(self.kv_a_layernorm(c)).view(b, s, self.H, self.dn + self.dv)
        k_nope, v = kv.split([self.dn, self.dv], dim=-1)                      # [B, S, H, Dn], [B, S, H, Dv]
        q_pe, k_pe = rope.apply(q_pe), rope.apply(k_pe[:, :, None])           # rotated, [B, S, H|1, R]
        q = torch.cat([q_nope, q_pe], dim=-1)                                 # [B, S, H, Dn + R]
        k = torch.cat([k_nope, k_pe.expand(-1, -1, self.H, -1)], dim=-1)
        v = F.pad(v, (0, self.dn + self.r - self.dv))                          # SDPA wants one head dim
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, scale=self.cfg.softmax_scale)
        return self.o_proj(o.transpose(1, 2)[..., : self.dv].reshape(b, s, self.H * self.dv))


class RopeTable(NamedTuple):
    """The YaRN cos/sin table of `layers/rope.py` and the positions 0 .. S-1 of one batch."""
    cos_sin: torch.Tensor       # [P, R] float32
    positions: torch.Tensor     # [B * S]
    batch: int

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        # x: [B, S, n, R] interleaved pairs -> rotated, de-interleaved halves (as `rope_ref`, the serving spec)
        b, s, n, r = x.shape
        return rope_ref(x.reshape(b * s, n, r), self.positions, self.cos_sin).view(b, s, n, r)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj, self.up_proj = linear(hidden, intermediate), linear(hidden, intermediate)
        self.down_proj = linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Gate(nn.Module):
    """Router: fp32 logits, noaux_tc choice; `e_score_correction_bias` is a buffer moved by `update_bias`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts))
        self.register_buffer("load", torch.zeros(cfg.n_routed_experts), persistent=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cfg
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x.float(), self.weight.float())                  # [T, E]
            weights, ids = moe_topk_ref(logits, c.num_experts_per_tok, topk_method=c.topk_method,
                                        scoring_func=c.scoring_func, n_group=c.n_group, topk_group=c.topk_group,
                                        norm_topk_prob=c.norm_topk_prob,
                                        routed_scaling_factor=c.routed_scaling_factor,
                                        e_score_correction_bias=self.e_score_correction_bias)
        if self.training:
            self.load += torch.bincount(ids.flatten(), minlength=c.n_routed_experts).float()
        return weights, ids.long()                                            # [T, K] f32, [T, K]

    @torch.no_grad()
    def update_bias(self, speed: float) -> None:
        """Auxiliary-loss-free balancing (DeepSeek-V3 sec. 2.1.2): raise the bias of under-loaded experts and
        lower that of over-loaded ones by `speed`, from the loads counted since the last update."""
        self.e_score_correction_bias += speed * torch.sign(self.load.mean() - self.load)
        self.load.zero_()


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = Gate(cfg)
        self.experts = nn.ModuleList(MLP(cfg.hidden_size, cfg.moe_intermediate_size)
                                     for _ in range(cfg.n_routed_experts))
        self.shared_experts = MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])                                          # [T, h]
        weights, ids = self.gate(x)
        return (self.routed(x, weights, ids) + self.shared_experts(x)).view(shape)

    def routed(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Sort the T*K (token, expert) pairs by expert, run each expert on its rows, scatter-add back."""
        k = ids.shape[1]
        order = ids.flatten().argsort(stable=True)                             # [T*K]
        token = order // k
        counts = torch.bincount(ids.flatten(), minlength=len(self.experts)).tolist()
        rows = x[token].split(counts)
        out = torch.cat([e(r) for e, r in zip(self.experts, rows)])            # [T*K, h]
        out = out * weights.flatten()[order, None].to(out.dtype)
        return torch.zeros_like(x).index_add_(0, token, out.to(x.dtype))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLA(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MoE(cfg) if cfg.is_moe_layer(layer_id) else MLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(self, x: torch.Tensor, rope: RopeTable) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, ids: torch.Tensor, rope: RopeTable) -> torch.Tensor:
        x = self.embed_tokens(ids)                                            # [B, S, h]
        for layer in self.layers:
            x = layer(x, rope)
        return self.norm(x)


class SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class NextN(nn.Module):
    """MTP module: position i combines the main model's final-normed hidden state at i with the embedding of
    token i+1 and predicts token i+2 (the serving `NextNLayer`); embedding and output head are shared."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.eh_proj = linear(2 * cfg.hidden_size, cfg.hidden_size)
        self.block = Block(cfg, cfg.num_hidden_layers)
        self.shared_head = SharedHead(cfg)

    def forward(self, next_emb: torch.Tensor, hidden: torch.Tensor, rope: RopeTable) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(next_emb), self.hnorm(hidden)], dim=-1))   # [B, S, h]
        return self.shared_head.norm(self.block(x, rope))


class Output(NamedTuple):
    logits: torch.Tensor        # [B, S, V]: token i+1
    mtp_logits: torch.Tensor    # [B, S, V]: token i+2


class DemoTrainModel(nn.Module):
    def __init__(self, cfg: ModelConfig, max_pos: int):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = linear(cfg.hidden_size, cfg.vocab_size)
        self.mtp = NextN(cfg)
        self.register_buffer("cos_sin", build_cos_sin_cache(cfg, max_pos), persistent=False)
        self.apply(_init)
        for name, p in self.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):            # residual branches (GPT-2)
                nn.init.normal_(p, std=INIT_STD / (2 * (cfg.num_hidden_layers + 1)) ** 0.5)

    def rope(self, b: int, s: int) -> RopeTable:
        pos = torch.arange(s, device=self.cos_sin.device).repeat(b)
        return RopeTable(self.cos_sin, pos, b)

    def forward(self, tokens: torch.Tensor) -> Output:
        """tokens [B, S + 2] -> logits for tokens[:, 1:S+1] and MTP logits for tokens[:, 2:S+2]."""
        b, s = tokens.shape[0], tokens.shape[1] - 2
        rope = self.rope(b, s)
        hidden = self.model(tokens[:, :s], rope)                              # [B, S, h] final-normed
        mtp = self.mtp(self.model.embed_tokens(tokens[:, 1:s + 1]), hidden, rope)
        return Output(self.lm_head(hidden), self.lm_head(mtp))

    def gates(self) -> list[Gate]:
        return [m for m in self.modules() if isinstance(m, Gate)]


def _init(m: nn.Module) -> None:
    if isinstance(m, (nn.Linear, nn.Embedding)):
        nn.init.normal_(m.weight, std=INIT_STD)
    elif isinstance(m, Gate):
        nn.init.normal_(m.weight, std=INIT_STD)


def checkpoint_state(model: DemoTrainModel) -> dict[str, torch.Tensor]:
    """The original checkpoint's tensors (bf16; the router bias float32) in `checkpoint_specs` order.

    The MTP layer becomes `model.layers.{n}` with copies of the shared embedding and output head."""
    cfg = model.cfg
    p = f"model.layers.{cfg.num_hidden_layers}."
    mine = {}
    for name, t in model.state_dict().items():
        if name.startswith("mtp."):
            name = p + name.removeprefix("mtp.").removeprefix("block.")
        mine[name] = t
    mine[p + "embed_tokens.weight"] = mine["model.embed_tokens.weight"]
    mine[p + "shared_head.head.weight"] = mine["lm_head.weight"]
    out = {}
    for spec in checkpoint_specs(cfg):
        t = mine.pop(spec.name)
        assert tuple(t.shape) == spec.shape, (spec.name, t.shape, spec.shape)
        dtype = torch.float32 if spec.kind == "bias" else torch.bfloat16
        out[spec.name] = t.detach().to("cpu", dtype).contiguous()
    assert not mine, f"tensors outside the checkpoint layout: {sorted(mine)[:3]}"
    return out
