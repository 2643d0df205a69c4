"""The physical floor of a step (DESIGN.md sec. 5), computed from the config alone.

Decode at small batch is bound by HBM bytes: the weights the step touches (attention, dense and shared
MLPs, the distinct routed experts hit, lm_head) plus the latent KV cache read. Prefill is bound by
tensor-core FLOPs of the matmuls and attention.
"""
from __future__ import annotations

from mlaserve.config import ModelConfig


def _linear_bytes(cfg: ModelConfig, n: int, k: int, fp8: bool) -> float:
    if fp8:
        return n * k + 4 * -(-n // 128) * -(-k // 128)
    return 2 * n * k


def attention_params(cfg: ModelConfig) -> list[tuple[int, int]]:
    h, hid = cfg.num_attention_heads, cfg.hidden_size
    shapes = [(cfg.kv_cache_dim, hid), (h * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
              (hid, h * cfg.v_head_dim)]
    if cfg.q_lora_rank is None:
        shapes.append((h * cfg.qk_head_dim, hid))
    else:
        shapes += [(cfg.q_lora_rank, hid), (h * cfg.qk_head_dim, cfg.q_lora_rank)]
    return shapes


def mlp_params(hid: int, inter: int) -> list[tuple[int, int]]:
    return [(inter, hid), (inter, hid), (hid, inter)]


def expected_experts_hit(cfg: ModelConfig, tokens: int) -> float:
    """Distinct routed experts touched by `tokens` tokens under uniform routing: E (1 - (1 - k/E)^tokens)."""
    e, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    return e * (1 - (1 - k / e) ** tokens) if e else 0.0


def decode_step_bytes(cfg: ModelConfig, batch: int, context: int, *, fp8: bool | None = None,
                      kv_bytes: int = 2, tp: int = 1) -> dict[str, float]:
    """Bytes one decode step must read on one rank: weights touched + KV cache (each read once). Under tensor
    parallelism (`tp`) a rank reads 1/tp of the head-split attention weights, of every MLP / expert and of the
    vocabulary, and all of the replicated q_a / kv_a projections, routers and latent KV cache."""
    fp8 = cfg.is_fp8 if fp8 is None else fp8
    replicated = {(cfg.kv_cache_dim, cfg.hidden_size), (cfg.q_lora_rank, cfg.hidden_size)}   # kv_a, q_a
    attn = sum(_linear_bytes(cfg, n, k, fp8) / (1 if (n, k) in replicated else tp)
               for n, k in attention_params(cfg)) * cfg.num_hidden_layers
    dense = moe = 0.0
    expert = sum(_linear_bytes(cfg, n, k, fp8) for n, k in mlp_params(cfg.hidden_size, cfg.moe_intermediate_size))
    expert /= tp
    for i in range(cfg.num_hidden_layers):
        if cfg.is_moe_layer(i):
            moe += expected_experts_hit(cfg, batch) * expert + expert * cfg.n_shared_experts
            moe += 2 * cfg.n_routed_experts * cfg.hidden_size                   # router
        else:
            dense += sum(_linear_bytes(cfg, n, k, fp8) for n, k in mlp_params(cfg.hidden_size, cfg.intermediate_size))
    dense /= tp
    head = 2 * cfg.vocab_size * cfg.hidden_size / tp
    kv = batch * context * cfg.kv_cache_dim * kv_bytes * cfg.num_hidden_layers
    return {"attention": attn, "dense_mlp": dense, "moe": moe, "lm_head": head, "kv_cache": kv,
            "total": attn + dense + moe + head + kv}


def prefill_flops(cfg: ModelConfig, tokens: int, prefix: int = 0) -> float:
    """Matmul FLOPs of prefilling `tokens` new tokens (causal attention, non-absorbed form)."""
    per_token = sum(n * k for n, k in attention_params(cfg)) * cfg.num_hidden_layers
    for i in range(cfg.num_hidden_layers):
        if cfg.is_moe_layer(i):
            active = cfg.num_experts_per_tok + cfg.n_shared_experts
            per_token += active * sum(n * k for n, k in mlp_params(cfg.hidden_size, cfg.moe_intermediate_size))
        else:
            per_token += sum(n * k for n, k in mlp_params(cfg.hidden_size, cfg.intermediate_size))
    per_token += cfg.vocab_size * cfg.hidden_size / max(tokens, 1)       # lm_head on the last token only
    h = cfg.num_attention_heads
    pairs = tokens * prefix + tokens * (tokens + 1) / 2
    attn = 2 * pairs * h * (cfg.qk_head_dim + cfg.v_head_dim) * cfg.num_hidden_layers
    return 2 * per_token * tokens + attn
