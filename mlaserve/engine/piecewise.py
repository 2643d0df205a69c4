"""Piecewise CUDA graphs for extend (prefill) batches (`--enable-piecewise-cuda-graph`).

An eager prefill issues ~30 launches per layer from Python, and on an H100 the host issues them more slowly than
the GPU runs them (benchmarks/results/decode-check-h100.md: 4096 tokens of V2-Lite, 47 ms of kernels in 70-78 ms).
Here the model's forward over a fixed token count is captured as one CUDA graph per stretch between two attention
calls; only the attention (whose launch grid and metadata depend on how the tokens split into requests) runs
eagerly in between:

    piece 0: embed, layer 0 up to its attention inputs | attention 0 | piece 1: o_proj, MoE, layer 1 up to its
    attention inputs | attention 1 | ... | piece L: the last layer's o_proj, MoE and the final norm

A batch of T tokens runs in the graphs of the smallest captured count Tb >= T. Its rows T .. Tb - 1 are padding:
token 0 at position 0 writing its latent row to the padding slot 0 (as the decode graphs' padding rows); every
piece treats rows independently, attention runs on the first T rows only, so padding changes nothing real.

The attention's inputs (q, kv_c, k_pe, and the new tokens' k_nope / v: kv_b_proj runs inside the piece) live in the
graphs' memory pool at the addresses they had when captured; the runner keeps non-owning views of them (`_alias`),
because owning them would keep every layer's q and expanded keys alive at once. The memory they view is free again after the attention reads it, exactly as in the eager
forward the capture recorded. Its output is copied into one static buffer the next piece reads.
`capture=False` runs the same padded, split forward eagerly (the CPU tests of that layout: no CUDA there).

Under DP attention (`dp_size`) the pieces of size Tb are captured with every group giving Tb rows to each MoE's
gather (counts [Tb] * D, as the decode graphs). All ranks run the pieces of the size they agreed on for the step
(`scheduler/dp_sync.DPStepSync`: the smallest captured count that holds the largest group's extend); a group
without tokens runs them on padding rows only, with no attention in between (`run_idle`), so the gathers line up.
"""
from __future__ import annotations

import bisect
import logging
import time

import torch

from mlaserve.core import ForwardContext, ForwardMode
from mlaserve.kernels.gemv import bucket_rows

logger = logging.getLogger(__name__)
MIN_TOKENS = 16


def default_token_sizes(max_tokens: int) -> list[int]:
    """Captured token counts: 16, then four per power of two (as `bucket_rows`: at most 25% padding), up to
    max_tokens (included)."""
    sizes = {bucket_rows(m) for m in range(MIN_TOKENS, max_tokens + 1)}
    return sorted({s for s in sizes if s <= max_tokens} | {min(MIN_TOKENS, max_tokens), max_tokens})


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A view of t's memory that does not keep it allocated."""
    storage = torch._C._construct_storage_from_data_pointer(t.untyped_storage().data_ptr(), t.device,
                                                            t.untyped_storage().nbytes())
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, t.storage_offset(), t.shape, t.stride())


class _Split:
    """One attention call between two pieces: the layer and its inputs at their captured addresses."""

    __slots__ = ("attn", "q", "kv_c", "k_pe", "kv_new")

    def __init__(self, attn, q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_new):
        self.attn, self.q, self.kv_c, self.k_pe, self.kv_new = attn, q, kv_c, k_pe, kv_new

    def run(self, t: int, ctx: ForwardContext) -> torch.Tensor:
        kv_new = None if self.kv_new is None else (self.kv_new[0][:t], self.kv_new[1][:t])
        return self.attn.attend_extend(self.q[:t], self.kv_c[:t], self.k_pe[:t], kv_new, ctx)


class PiecewiseGraphRunner:
    """Captures the extend forward of `model` (a DeepseekForCausalLM) at each of `token_sizes`; `run(ids, ctx)`
    returns the ModelOutput of a real extend batch of at most max(token_sizes) tokens."""

    def __init__(self, model: torch.nn.Module, kv_pool, attn_backend, req_to_token: torch.Tensor, dummy_req: int,
                 token_sizes: list[int], device: torch.device, capture: bool = True, dp_size: int | None = None):
        self.model, self.sizes, self.captured, self.dp_size = model, sorted(token_sizes), capture, dp_size
        assert self.sizes and self.sizes[0] >= 1, f"token sizes must be >= 1, got {token_sizes}"
        cfg = model.cfg
        n = self.sizes[-1]
        # rows: input ids, positions, output slots; the padding rows: token 0, position 0, slot 0
        self.inputs = torch.zeros(3, n, dtype=torch.int64, device=device)
        self.attn_out = torch.zeros(n, model.num_local_heads, cfg.v_head_dim, dtype=model.dtype, device=device)
        self.ctxs = {tb: self._ctx(tb, kv_pool, attn_backend, req_to_token, dummy_req, device) for tb in self.sizes}
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.splits: dict[int, list[_Split]] = {}
        self.hidden: dict[int, torch.Tensor] = {}
        self.pool = None
        self.runs = 0                                     # batches run (the scheduler's piecewise_graph_steps)
        self.capture_s, self.pool_bytes = 0.0, 0         # capture time; memory reserved during it (pool, warm-up)
        if capture:
            self._capture()

    def _ctx(self, tb: int, kv_pool, attn_backend, req_to_token, dummy_req: int, device) -> ForwardContext:
        """The context the pieces are captured with: one request of tb new tokens and no prefix (what the
        capture-time attention computes; replays run the real batch's attention)."""
        return ForwardContext(
            mode=ForwardMode.EXTEND, positions=self.inputs[1, :tb], out_slots=self.inputs[2, :tb],
            req_pool_idx=torch.tensor([dummy_req], dtype=torch.int64, device=device),
            seq_lens=torch.tensor([tb], dtype=torch.int32, device=device), seq_lens_cpu=[tb], extend_lens_cpu=[tb],
            req_to_token=req_to_token, kv_pool=kv_pool, attn_backend=attn_backend, logits_indices=None,
            global_num_tokens=[tb] * self.dp_size if self.dp_size else None)

    def can_run(self, ctx: ForwardContext) -> bool:
        """Whether a batch without DP attention fits the pieces (under it the ranks agree: `run(..., pad_to)`)."""
        t = ctx.positions.shape[0]
        return ctx.mode is ForwardMode.EXTEND and 0 < t <= self.sizes[-1] and ctx.global_num_tokens is None

    def _size(self, t: int) -> int:
        return self.sizes[bisect.bisect_left(self.sizes, t)]

    # --- capture -----------------------------------------------------------------------------
    @torch.no_grad()
    def _capture(self) -> None:
        t0, reserved = time.monotonic(), torch.cuda.memory_reserved()
        self.pool = torch.cuda.graph_pool_handle()        # one memory pool for every piece of every size
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for tb in reversed(self.sizes):               # largest first: the smaller ones reuse its memory
                self._capture_size(tb)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        self.capture_s, self.pool_bytes = time.monotonic() - t0, torch.cuda.memory_reserved() - reserved
        logger.info("captured piecewise extend CUDA graphs for %d token counts (%d..%d, %d pieces each) in %.1f s, "
                    "%.2f GiB", len(self.sizes), self.sizes[0], self.sizes[-1], len(self.graphs[self.sizes[-1]]),
                    self.capture_s, self.pool_bytes / 2**30)

    def _capture_size(self, tb: int) -> None:
        ctx = self.ctxs[tb]
        ids, pos = self.inputs[0, :tb], self.inputs[1, :tb]
        for _ in range(2):                                # warm up: Triton compiles, cuBLAS picks its kernels
            self.model.model(ids, pos, ctx)
        graphs: list[torch.cuda.CUDAGraph] = []
        splits: list[_Split] = []

        def begin() -> None:
            graphs.append(torch.cuda.CUDAGraph())
            graphs[-1].capture_begin(pool=self.pool)

        def split(attn, q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_new) -> torch.Tensor:
            graphs[-1].capture_end()
            kv_alias = None if kv_new is None else (_alias(kv_new[0]), _alias(kv_new[1]))
            splits.append(_Split(attn, _alias(q), _alias(kv_c), _alias(k_pe), kv_alias))
            out = self.attn_out[:tb]
            out.copy_(attn.attend_extend(q, kv_c, k_pe, kv_new, ctx))   # eager: the next piece sees real values
            begin()
            return out

        ctx.splitter = split
        try:
            begin()
            hidden = self.model.model(ids, pos, ctx)
            graphs[-1].capture_end()
        finally:
            ctx.splitter = None
        self.graphs[tb], self.splits[tb], self.hidden[tb] = graphs, splits, hidden
        # NOTE: a graph's first launch also uploads it to the device: do that here, not in a request's prefill (the
        # capture inputs: token 0 writing the padding slot). On the H100 no TTFT change showed beyond run-to-run
        # spread (benchmarks/results/piecewise-h100.md)
        for g in graphs:
            g.replay()

    # --- run ---------------------------------------------------------------------------------
    @torch.no_grad()
    def run(self, input_ids: torch.Tensor, ctx: ForwardContext, pad_to: int | None = None):
        """The ModelOutput of an extend batch (`can_run`): input_ids [T] on the device, ctx its context. `pad_to`:
        the captured count to run (DP attention: the one every rank agreed on), else the smallest that holds T."""
        t = input_ids.shape[0]
        tb = self._size(t) if pad_to is None else pad_to
        assert 0 < t <= tb and tb in self.ctxs, f"{t} tokens in the pieces of {tb}"
        self.runs += 1
        self.inputs[0, :t].copy_(input_ids)
        self.inputs[1, :t].copy_(ctx.positions)
        self.inputs[2, :t].copy_(ctx.out_slots)
        return self.model.head(self._forward(t, tb, ctx), ctx)

    @torch.no_grad()
    def run_idle(self, tb: int) -> None:
        """DP attention: this group's part in a step whose other groups extend through the pieces of tb tokens
        (agreed): tb padding rows through every piece, their rows in each MoE's gather; no attention, no logits."""
        assert tb in self.ctxs and self.dp_size, f"idle pieces of {tb} tokens (dp_size {self.dp_size})"
        self._forward(0, tb, None)

    def _forward(self, t: int, tb: int, ctx: ForwardContext | None) -> torch.Tensor:
        """The final hidden states [t, h] of the first t rows of `inputs` (set by the caller), padded to tb; the
        attention between pieces runs on those t rows with ctx (none when t is 0: the padding rows' attention
        outputs are whatever `attn_out` holds, finite, and nothing reads the rows they make)."""
        if tb > t:
            self.inputs[:, t:tb].zero_()                  # padding rows: token 0, position 0, the padding slot 0
        if not self.captured:
            return self._run_eager(t, tb, ctx)
        graphs = self.graphs[tb]
        graphs[0].replay()
        for s, g in zip(self.splits[tb], graphs[1:]):
            if t:
                self.attn_out[:t].copy_(s.run(t, ctx))
            g.replay()
        return self.hidden[tb][:t]

    def _run_eager(self, t: int, tb: int, ctx: ForwardContext | None) -> torch.Tensor:
        """The padded forward of the graphs, split the same way, run eagerly (capture=False)."""
        pad = self.ctxs[tb]

        def split(attn, q: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, kv_new) -> torch.Tensor:
            if t:
                self.attn_out[:t].copy_(_Split(attn, q, kv_c, k_pe, kv_new).run(t, ctx))
            return self.attn_out[:tb]

        pad.splitter = split
        try:
            return self.model.model(self.inputs[0, :tb], self.inputs[1, :tb], pad)[:t]
        finally:
            pad.splitter = None
