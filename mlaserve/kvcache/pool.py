"""The MLA latent KV pool: per layer one row of kv_lora_rank + qk_rope_head_dim values per token slot.

Slot 0 is the padding slot (dummy writes of padded batches land there); usable slots are 1..size.
An FP8 pool stores value / kv_scale as e4m3 or e5m2 (written by `ops.mla_rope_kv_store`).
"""
from __future__ import annotations

import torch

# resolved --kv-cache-dtype names (config_resolve.py) -> storage dtype
KV_CACHE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
                   "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def kv_bytes_per_token(num_layers: int, row_dim: int, dtype: torch.dtype) -> int:
    """Bytes one token occupies in the pool: one row of L + R values per layer, in the cache dtype."""
    return num_layers * row_dim * torch.empty((), dtype=dtype).element_size()


class MLAKVPool:
    def __init__(self, size: int, num_layers: int, kv_lora_rank: int, rope_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", kv_scale: float = 1.0):
        self.size, self.num_layers = size, num_layers
        self.kv_lora_rank, self.rope_dim = kv_lora_rank, rope_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.is_fp8 = dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        self.kv_scale = kv_scale if self.is_fp8 else None
        self.buffers = [torch.zeros(size + 1, kv_lora_rank + rope_dim, dtype=dtype, device=device)
                        for _ in range(num_layers)]

    @property
    def row_dim(self) -> int:
        return self.kv_lora_rank + self.rope_dim

    def bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.num_layers, self.row_dim, self.dtype)

    def kv_buffer(self, layer: int) -> torch.Tensor:
        """[size + 1, L + R] storage of one layer (FP8 rows need `* kv_scale`)."""
        return self.buffers[layer]

    def load(self, layer: int, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows of `slots` as `dtype` ([n, L + R]), dequantised for an FP8 pool."""
        rows = self.buffers[layer][slots]
        return rows.float().mul(self.kv_scale).to(dtype) if self.is_fp8 else rows.to(dtype)

    def copy_rows(self, src: torch.Tensor, dst: torch.Tensor, num_layers: int) -> None:
        """Row dst[i] <- row src[i] in layers 0 .. num_layers - 1 (every source read before any write)."""
        for buf in self.buffers[:num_layers]:
            buf[dst] = buf[src]
