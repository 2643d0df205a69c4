"""Core types shared by every level: the forward mode and the per-batch forward context."""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from mlaserve.attention.base import BaseAttnBackend
    from mlaserve.kvcache.pool import MLAKVPool


class ForwardMode(enum.Enum):
    EXTEND = "extend"   # prefill or chunked extend: new tokens of several requests, any count each
    DECODE = "decode"   # one new token per request (num_q > 1 only for speculative verification)


@dataclass
class ForwardContext:
    """What one model forward needs besides the token ids: where KV goes and which cache rows it reads.

    Legend: `T` new tokens in the batch, `B` requests. Request b's new tokens are the contiguous range
    of T given by `extend_lens`; they sit at positions prefix_lens[b] .. seq_lens[b] - 1.

        req_to_token[req_pool_idx[b], 0 : seq_lens[b]]  -> KV-cache slots of request b
        |<---- prefix_lens[b] (cached) ---->|<- extend_lens[b] (new) ->|
    """

    mode: ForwardMode
    positions: torch.Tensor          # [T] int64
    out_slots: torch.Tensor          # [T] int64: slot each new token's latent KV is written to
    req_pool_idx: torch.Tensor       # [B] int64
    seq_lens: torch.Tensor           # [B] int32 (device), prefix + new
    extend_lens: torch.Tensor        # [B] int32 (device)
    prefix_lens: torch.Tensor        # [B] int32 (device)
    seq_lens_cpu: list[int]
    extend_lens_cpu: list[int]
    req_to_token: torch.Tensor       # [max_reqs, max_context] int32
    kv_pool: "MLAKVPool"
    attn_backend: "BaseAttnBackend"
    num_q: int = 1                   # query tokens per request in DECODE mode
    logits_indices: torch.Tensor | None = None   # rows of T whose logits are wanted (None: all)

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def prefix_lens_cpu(self) -> list[int]:
        return [s - e for s, e in zip(self.seq_lens_cpu, self.extend_lens_cpu)]
