"""Build the ForwardContext of one batch from per-request slot lists (positions, output slots, lengths)."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from mlaserve.core import ForwardContext, ForwardMode


def upload_ints(pieces: Sequence[Sequence[int] | np.ndarray | torch.Tensor],
                device: torch.device | str) -> list[torch.Tensor]:
    """The host integer pieces as int64 tensors on `device`, in one transfer: written into one pinned buffer (numpy
    writes: a list of 4,096 ints converts in a third of torch.tensor's time) and copied without waiting for the
    device. Each result is a view of one device tensor. Tensors among the pieces must be on the CPU.

    NOTE: an eager extend used to upload six tensors, each pinned and copied on its own: about 0.3-0.5 ms of host time
    before a 4,096-token prefill's first kernel, when the GPU has nothing else to run
    (benchmarks/results/extend-staging-h200.md)."""
    device = torch.device(device)
    sizes = [len(p) for p in pieces]
    host = torch.empty(sum(sizes), dtype=torch.int64, pin_memory=device.type == "cuda")
    view, o = host.numpy(), 0
    for p, n in zip(pieces, sizes):
        view[o:o + n] = p.numpy() if isinstance(p, torch.Tensor) else p
        o += n
    # NOTE: the caching host allocator keeps the pinned block until the copy recorded on it has run
    dev = host.to(device, non_blocking=True) if device.type == "cuda" else host.to(device)
    return list(dev.split(sizes))


def build_context(mode: ForwardMode, *, req_pool_idx: list[int], prefix_lens: list[int],
                  extend_lens: list[int], out_slots: torch.Tensor, req_to_token: torch.Tensor,
                  kv_pool, attn_backend, device: torch.device | str, num_q: int = 1,
                  last_token_logits: bool = True, num_decode: int = 0, logits_rows: Sequence[int] | None = None,
                  input_ids: Sequence[int] | None = None) -> ForwardContext:
    """Requests' new tokens are laid out back to back; request b's sit at positions
    prefix_lens[b] .. prefix_lens[b] + extend_lens[b] - 1. `out_slots` [T] must already be written
    into `req_to_token` at those positions. With `last_token_logits`, logits are computed only for the
    last new token of each request; `logits_rows` names the rows of T wanted instead (None with it False: all).
    `num_decode` (EXTEND only): the last requests are one-token decodes of a mixed batch (`ForwardContext.split_mixed`).
    `input_ids` [T]: uploaded with the rest, to `ctx.input_ids`. Every host input goes up in one copy
    (`upload_ints`)."""
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    positions = np.concatenate([np.arange(p, s) for p, s in zip(prefix_lens, seq_lens)]) if seq_lens else ()
    if last_token_logits:
        logits_rows = np.cumsum(extend_lens, dtype=np.int64) - 1
    host_slots = out_slots.device.type == "cpu"          # (some callers hold them on the device already)
    pieces = [positions, req_pool_idx, seq_lens] + ([out_slots] if host_slots else [])
    if logits_rows is not None:
        pieces.append(logits_rows)
    if input_ids is not None:
        pieces.append(input_ids)
    dev = upload_ints(pieces, device)
    ctx = ForwardContext(
        mode=mode, positions=dev[0], req_pool_idx=dev[1], seq_lens=dev[2],
        out_slots=dev[3] if host_slots else out_slots.to(device), seq_lens_cpu=seq_lens,
        extend_lens_cpu=list(extend_lens),
        req_to_token=req_to_token, kv_pool=kv_pool, attn_backend=attn_backend, num_q=num_q,
        logits_indices=dev[3 + host_slots] if logits_rows is not None else None, num_decode=num_decode,
        input_ids=dev[-1] if input_ids is not None else None)
    if num_decode:
        ctx.parts = ctx.split_mixed()
    return ctx
