"""The attention-backend seam: MLA attention over the latent KV cache, absorbed (decode) or not (extend)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable

import torch

from mlaserve.core import ForwardContext

# expand_kv(latent [n, L]) -> (k_nope [n, H, Dn], v [n, H, Dv]): applies kv_b_proj
ExpandKV = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
KVNew = tuple[torch.Tensor, torch.Tensor]    # the new tokens' (k_nope [T, H, Dn], v [T, H, Dv]), expanded by the caller


class BaseAttnBackend(ABC):
    """MLA attention for one batch. Shapes: `T` new tokens, `H` local heads, `L` kv_lora_rank, `R` rope dim.

    The caller has already written the new tokens' latent rows into the pool (`ctx.out_slots`), so every
    cache row a query may see is in `ctx.kv_pool` through `ctx.req_to_token`.
    """

    # True when decode reads the host sequence lengths (`ctx.seq_lens_cpu`): the PyTorch reference does; a kernel
    # reads `ctx.seq_lens` on the device (speculative steps then need not bring their lengths to the host)
    host_seq_lens = False
    # True when extend takes the new tokens' k_nope / v expanded by the caller (`kv_new`): the model then runs
    # kv_b_proj before the attention call, inside a piecewise graph's piece rather than in the eager attention
    takes_new_kv = False

    def __init__(self, sm_scale: float, kv_lora_rank: int, rope_dim: int):
        self.sm_scale, self.kv_lora_rank, self.rope_dim = sm_scale, kv_lora_rank, rope_dim

    @abstractmethod
    def extend(self, layer: int, q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor,
               ctx: ForwardContext, expand_kv: ExpandKV, kv_new: KVNew | None = None) -> torch.Tensor:
        """Non-absorbed MLA. q: [T, H, Dn + R], kv_c: [T, L], k_pe: [T, R] (the new tokens) -> [T, H, Dv].
        kv_new: expand_kv(kv_c), given by the caller when the backend `takes_new_kv` (else None)."""

    @abstractmethod
    def decode(self, layer: int, q: torch.Tensor, q_pe: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Absorbed MLA. q: [T, H, L] latent query, q_pe: [T, H, R] roped query -> o_latent [T, H, L]."""

    def decode_chain(self, layer: int, q_nope: torch.Tensor, w_kc: torch.Tensor, w_vc: torch.Tensor, rope: tuple,
                     rope_kw: dict, ctx: ForwardContext) -> torch.Tensor | None:
        """The whole absorbed decode in one launch where the backend has one for this batch: W_UK (q_nope [T, H, Dn]
        @ w_kc [H, Dn, L]), the rope and cache write (`mla_rope_kv_store`'s `rope` arguments and `rope_kw`), the
        attention and W_UV (w_vc [H, Dv, L]) -> o [T, H, Dv]; None: the caller runs the parts."""
        return None
