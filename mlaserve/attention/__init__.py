"""Attention backends behind one registry; implementations are imported lazily."""
from __future__ import annotations

from mlaserve.attention.base import BaseAttnBackend

_BACKENDS = {
    "torch": ("mlaserve.attention.torch_ref", "TorchMLABackend"),
    "triton": ("mlaserve.attention.triton", "TritonMLABackend"),
}


def create_attn_backend(name: str, sm_scale: float, kv_lora_rank: int, rope_dim: int) -> BaseAttnBackend:
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choices: {', '.join(_BACKENDS)}")
    import importlib

    module, cls = _BACKENDS[name]
    return getattr(importlib.import_module(module), cls)(sm_scale, kv_lora_rank, rope_dim)
