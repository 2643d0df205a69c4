"""CUDA graphs for decode: one graph per captured batch size; a batch is padded to the next captured size.

Padded rows decode a dummy request whose single cache position is the padding slot 0, so they read and
write nothing real. Sampling runs after the replay, outside the graph.

A step's host inputs (positions, output slots, pool rows) travel as ONE pinned [3, bs] copy into a device buffer
the graph reads; the graph itself derives the sequence lengths (positions + 1) and gathers the input tokens from
the runner's `token_buf` (the previous step's samples, already on the device), so a replay costs the host one copy
and one launch.

Under DP attention (`dp_size`) each graph of size bs is captured with every group contributing bs rows to the MoE
gather; all ranks replay the graph of the size they agreed on (`scheduler/dp_sync.DPStepSync`: the capture size of
the largest group's batch), a group without requests replaying it with padding rows only. `capture=False` runs
the same padded function eagerly instead of replaying: the CPU tests of that layout (no CUDA there), and
torch.compile without graphs (--enable-torch-compile --disable-cuda-graph: the compiled padded forward of each size,
compiled at start-up with `warm`).
"""
from __future__ import annotations

import bisect
import contextlib
import logging
import os
import time

import torch

from mlaserve.core import ForwardContext, ForwardMode, make_compile_opaque
from mlaserve.engine.spec_tree import DraftTree, accept_tree, draft_tree, query_counts, slots_per_step, verify_tree
from mlaserve.kernels import mla_chain
from mlaserve.kernels.mla_decode import choose_num_kv_splits, decode_programs

logger = logging.getLogger(__name__)


def pad_mask_on() -> bool:
    """Whether padded graphs route their padding rows to no expert (default); MLASERVE_PAD_MASK=0 turns it off,
    for A/B runs (benchmarks/gpu_pad_mask.sh)."""
    return os.environ.get("MLASERVE_PAD_MASK", "1") != "0"


def allow_recompiles(layers: int, sizes: int) -> dict[str, int]:
    """Raise dynamo's recompile limits to what compiled decode graphs need, and return them. A frame past a graph
    break (every Triton launcher is one) resumes in each layer, whose integer attributes (layer_id) dynamo guards as
    constants, so it is compiled once per layer and batch size: V3 at 10 layers and the 7 sizes up to 32 needs 70
    entries of one frame. Past the limit dynamo runs the rest of the frame eagerly (with a warning). Room for four
    times layers x sizes: speculative decoding runs the target at two token counts a batch size (verify, repair)
    and the draft at its own. A limit is only a cap (entries are made as shapes come); one already higher is
    kept."""
    from torch._dynamo import config

    want = 4 * max(layers, 1) * max(sizes, 1) + 64
    names = [n for n in ("recompile_limit", "accumulated_recompile_limit") if hasattr(config, n)] \
        or ["cache_size_limit", "accumulated_cache_size_limit"]        # (the names before torch 2.7)
    for name in names:
        setattr(config, name, max(getattr(config, name), want))
    return {name: getattr(config, name) for name in names}


class DecodeGraphRunner:
    """Captures `model` decode forwards; `replay(...)` returns the logits [bs, V] of a real batch."""

    STAGING = 4        # pinned input buffers in rotation: one is refilled only after its copy has run

    def __init__(self, model: torch.nn.Module, kv_pool, attn_backend, req_to_token: torch.Tensor,
                 dummy_req: int, batch_sizes: list[int], max_context: int, device: torch.device,
                 token_buf: torch.Tensor, compile_max_bs: int = 0, dp_size: int | None = None,
                 capture: bool = True, warm: bool = False):
        self.model, self.batch_sizes = model, sorted(batch_sizes)
        self.dp_size, self.captured = dp_size, capture
        self.compile_max_bs = compile_max_bs
        self.compiled = None
        if compile_max_bs:
            # NOTE: graph breaks at the Triton launchers are fine: dynamo compiles the torch code between them
            allow_recompiles(model.num_kv_layers, sum(b <= compile_max_bs for b in self.batch_sizes))
            make_compile_opaque()
            self.compiled = torch.compile(model, dynamic=False)
        self.dummy_req, self.device = dummy_req, device
        n = self.batch_sizes[-1]
        # rows of `inputs`: positions, output slots, pool rows (the padding rows: position 0, slot 0, dummy row),
        # and the requests of each DP group this step (its first `groups` columns; one group without DP attention)
        self.groups = dp_size or 1
        width = max(n, self.groups)
        self.inputs = torch.tensor([[0] * width, [0] * width, [dummy_req] * width, [0] * width], dtype=torch.int64,
                                   device=device)
        self.positions, self.out_slots, self.req_pool_idx = self.inputs[0], self.inputs[1], self.inputs[2]
        # the MoE's rows [groups * bs] that are requests' (group d's first counts[d] of its bs), made by the
        # prologue from the counts: padding rows then route to no expert (no weights read for them)
        self.masking = pad_mask_on()
        self.group_counts = self.inputs[3, : self.groups]
        self.columns = torch.arange(n, device=device)
        self.row_mask = torch.ones(self.groups * n, dtype=torch.bool, device=device)
        self.staging = [self.inputs.cpu().pin_memory() if capture else self.inputs.cpu() for _ in range(self.STAGING)]
        self.staging_np = [h.numpy() for h in self.staging]      # the same memory: numpy writes cost no aten ops
        self.staged: list[torch.cuda.Event | None] = [None] * self.STAGING
        self.next_staging = 0
        self.token_buf = token_buf        # [pool rows] each request's last sampled token (the runner's)
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        # size 1's second graph, the attention chain's (`_capture`), its logits, the longest context it replays for
        self.chain_graph: torch.cuda.CUDAGraph | None = None
        self.chain_output: torch.Tensor | None = None
        self.chain_context = 0
        self.chain_replays = 0
        self.ctxs: dict[int, ForwardContext] = {}
        req_to_token[dummy_req, 0] = 0
        self.pool = None
        if capture:
            self._capture(kv_pool, attn_backend, req_to_token, max_context)
        else:
            self.ctxs = {bs: self._ctx(bs, kv_pool, attn_backend, req_to_token, max_context) for bs in self.batch_sizes}
            if warm:
                self._warm()

    @torch.no_grad()
    def _warm(self) -> None:
        """capture=False: run each size's padded forward once on padding rows (torch.compile and Triton compile
        here, not in a user's step); under DP attention every rank runs the same sizes in the same order."""
        t0 = time.monotonic()
        for bs in reversed(self.batch_sizes):
            self.inputs[:2, :bs] = 0
            self.inputs[2, :bs] = self.dummy_req
            self.group_counts.fill_(bs)                       # every row routes, as in a full step
            self._prologue(bs)
            self._fn(bs)(self.input_ids[:bs], self.positions[:bs], self.ctxs[bs])
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        logger.info("compiled %d eager decode sizes (bs %s) in %.1f s", len(self.batch_sizes), self.batch_sizes,
                    time.monotonic() - t0)

    def _ctx(self, bs: int, kv_pool, attn_backend, req_to_token, max_context: int,
             chain: bool = False) -> ForwardContext:
        splits = choose_num_kv_splits(decode_programs(bs, self.model.num_local_heads), max_context)
        return ForwardContext(
            mode=ForwardMode.DECODE, positions=self.positions[:bs], out_slots=self.out_slots[:bs],
            req_pool_idx=self.req_pool_idx[:bs], seq_lens=self.seq_lens[:bs], seq_lens_cpu=[1] * bs,
            extend_lens_cpu=[1] * bs,
            req_to_token=req_to_token, kv_pool=kv_pool, attn_backend=attn_backend, num_q=1,
            logits_indices=None, num_kv_splits=splits,
            global_num_tokens=[bs] * self.dp_size if self.dp_size else None,
            moe_row_mask=self._row_mask(bs), chain=chain)

    def _chain_context(self, max_context: int) -> int | None:
        """The longest context the bs-1 chain graph replays for, or None where there is none to capture: the chain
        is on (MLASERVE_MLA_CHAIN), a CUDA device, no DP attention (its graphs replay agreed sizes, bs 0 included),
        size 1 captured, and few enough local heads (`mla_chain.CHAIN_MAX_HEADS`)."""
        if not (mla_chain.enabled() and self.device.type == "cuda" and self.dp_size is None
                and self.batch_sizes[0] == 1 and self.model.num_local_heads <= mla_chain.CHAIN_MAX_HEADS):
            return None
        return min(max_context, mla_chain.CHAIN_MAX_CONTEXT)

    @torch.no_grad()
    def _capture(self, kv_pool, attn_backend, req_to_token, max_context: int) -> None:
        t0 = time.monotonic()
        stream = torch.cuda.Stream()
        for bs in reversed(self.batch_sizes):             # largest first: later graphs reuse its memory
            ctx = self._ctx(bs, kv_pool, attn_backend, req_to_token, max_context)
            self.graphs[bs], self.outputs[bs] = self._capture_one(bs, ctx, stream)
            self.ctxs[bs] = ctx
        chain_context = self._chain_context(max_context)
        if chain_context is not None:
            # the one-launch attention chain (kernels/mla_chain.py) at one token: faster than the four launches at
            # short contexts, slower at long ones, and a graph's split count is fixed; so size 1 has a second
            # graph, its splits sized for chain_context, replayed while the context is at most that
            ctx = self._ctx(1, kv_pool, attn_backend, req_to_token, chain_context, chain=True)
            graph, out = self._capture_one(1, ctx, stream)
            if ctx.attn_cache.get("chain_ran"):
                self.chain_graph, self.chain_output, self.chain_context = graph, out, chain_context
            else:                                         # the layers' shapes did not fit the one launch
                logger.info("the attention chain does not fit this model's decode: no chain graph")
        torch.cuda.synchronize()
        chain = f" and the one-launch attention chain's bs-1 graph for contexts up to {self.chain_context} tokens" \
            if self.chain_graph is not None else ""
        logger.info("captured %d decode CUDA graphs (bs %s)%s in %.1f s", len(self.graphs), self.batch_sizes, chain,
                    time.monotonic() - t0)

    def _capture_one(self, bs: int, ctx: ForwardContext, stream) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        ids, pos = self.input_ids[:bs], self.positions[:bs]
        fn = self._fn(bs)
        self.group_counts.fill_(bs)                       # the warm-ups route every row, as a full step
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):                            # warm up: Triton and torch.compile compile here
                self._prologue(bs)
                fn(ids, pos, ctx)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, stream=stream):
            self._prologue(bs)
            out = fn(ids, pos, ctx).logits
        self.pool = graph.pool()
        return graph, out

    def pick(self, cbs: int, positions: list[int]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """(the graph, its logits) a step of captured size cbs replays at these positions: size 1's chain graph while
        the context (position + 1) is at most chain_context, else the size's graph."""
        if cbs == 1 and self.chain_graph is not None and positions and positions[0] < self.chain_context:
            return self.chain_graph, self.chain_output
        return self.graphs[cbs], self.outputs[cbs]

    def graph_of(self, bs: int, seq_len: int) -> torch.cuda.CUDAGraph:
        """The graph a step of bs requests replays when its longest sequence (cached + the new token) is seq_len."""
        return self.pick(self._capture_size(bs), [seq_len - 1])[0]

    def _fn(self, bs: int):
        return self.compiled if self.compiled is not None and bs <= self.compile_max_bs else self.model

    def _prologue(self, bs: int) -> None:
        """Captured first: each row's sequence length (its position + 1) and its input token, the last one sampled
        for its pool row (`token_buf`)."""
        torch.add(self.positions[:bs], 1, out=self.seq_lens[:bs])
        torch.index_select(self.token_buf, 0, self.req_pool_idx[:bs], out=self.input_ids[:bs])
        mask = self._row_mask(bs)
        if mask is not None:
            torch.lt(self.columns[:bs].expand(self.groups, bs), self.group_counts[:, None],
                     out=mask.view(self.groups, bs))

    def _row_mask(self, bs: int) -> torch.Tensor | None:
        """The MoE's row mask of a size-bs step (`row_mask`'s first groups * bs), or None where no row can be
        padding (one row in all) or MLASERVE_PAD_MASK=0."""
        return self.row_mask[: self.groups * bs] if self.masking and self.groups * bs > 1 else None

    def can_run(self, bs: int) -> bool:
        return bs <= self.batch_sizes[-1]

    def _capture_size(self, bs: int) -> int:
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, bs)]

    def replay_host(self, positions: list[int], out_slots: torch.Tensor, req_pool_idx: list[int],
                    pad_to: int | None = None,
                    group_counts: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode bs requests from host inputs: each one's position (its cached length), output slot ([bs] CPU
        tensor) and pool row, its input token being `token_buf[row]`. `pad_to`: the captured size to replay (DP
        attention: the one all ranks agreed on; bs may then be 0), else the smallest that holds bs.
        `group_counts` (DP attention): every group's requests this step (the agreed `global_num_tokens`), which
        tell the MoE its padding rows (without them every row routes); one group: bs. Returns (logits [bs, V], the
        pool rows on the device [bs]: a view valid until the next replay is queued)."""
        bs = len(positions)
        cbs = self._capture_size(bs) if pad_to is None else pad_to
        assert bs <= cbs and cbs in self.ctxs, f"{bs} requests in the graph of size {cbs}"
        i = self.next_staging
        self.next_staging = (i + 1) % self.STAGING
        if self.staged[i] is not None:
            self.staged[i].synchronize()                  # its previous copy has run (steps ago, in practice)
        host = self.staging_np[i]
        host[0, :bs] = positions
        host[1, :bs] = out_slots.numpy()
        host[2, :bs] = req_pool_idx
        host[:2, bs:cbs] = 0                                                # padding rows: the dummy request
        host[2, bs:cbs] = self.dummy_req
        if self.dp_size:
            host[3, : self.dp_size] = group_counts if group_counts is not None else cbs
        else:
            host[3, 0] = bs
        # NOTE: the whole staging tensor (4 x the largest size, a few KB): one copy, no slicing ops; columns past
        # cbs are stale and never read by this size's graph
        self.inputs.copy_(self.staging[i], non_blocking=True)
        if not self.captured:                             # the same padded forward, run eagerly
            # NOTE: the PyTorch reference attention reads the lengths on the host (a kernel reads `seq_lens`)
            ctx = self.ctxs[cbs]
            if ctx.attn_backend.host_seq_lens:        # (a kernel reads none: nothing for torch.compile to guard on)
                ctx.seq_lens_cpu = [p + 1 for p in positions] + [1] * (cbs - bs)
            self._prologue(cbs)
            out = self._fn(cbs)(self.input_ids[:cbs], self.positions[:cbs], self.ctxs[cbs]).logits
            return out[:bs], self.req_pool_idx[:bs]
        self.staged[i] = torch.cuda.Event()
        self.staged[i].record()
        graph, out = self.pick(cbs, positions)
        graph.replay()
        self.chain_replays += graph is self.chain_graph
        return out[:bs], self.req_pool_idx[:bs]

    def replay(self, input_ids: torch.Tensor, positions: torch.Tensor, out_slots: torch.Tensor,
               req_pool_idx: torch.Tensor, seq_lens: torch.Tensor | None = None) -> torch.Tensor:
        """Decode from device inputs (distinct pool rows; `input_ids` are written to `token_buf` at them). The
        sequence lengths are positions + 1, as in every decode step (`seq_lens` is not read)."""
        bs = input_ids.shape[0]
        cbs = self._capture_size(bs)
        self.token_buf[req_pool_idx] = input_ids
        self.positions[:bs].copy_(positions)
        self.out_slots[:bs].copy_(out_slots)
        self.req_pool_idx[:bs].copy_(req_pool_idx)
        self.inputs[:2, bs:cbs] = 0                                         # padding rows: the dummy request
        self.inputs[2, bs:cbs] = self.dummy_req
        self.group_counts.fill_(bs)
        self.graphs[cbs].replay()
        return self.outputs[cbs][:bs]


class SpecGraphRunner:
    """CUDA graphs for speculative decoding (`engine/spec.py`, tree drafts `engine/spec_tree.py`), per captured
    batch size: the draft steps and the verify forward as one graph, the acceptance and draft repair as another
    (the target's tokens are chosen between the two, outside: argmax or the seeded sampler). Padded rows run the
    dummy request, whose first positions all map to the padding slot 0. Under DP attention (`dp_size`) each
    forward of a size-bs pair is captured with every group giving it bs times its queries per request (the rows
    of the agreed size, as `DecodeGraphRunner`); `capture=False` runs the same padded functions eagerly (CPU tests)."""

    def __init__(self, spec, req_to_token: torch.Tensor, dummy_req: int, batch_sizes: list[int], max_context: int,
                 device: torch.device, compile_max_bs: int = 0, dp_size: int | None = None, capture: bool = True,
                 warm: bool = False):
        self.spec, self.batch_sizes = spec, sorted(batch_sizes)
        self.captured, self.compile_max_bs = capture, compile_max_bs
        eager, compiled = (spec.target_fn, spec.draft_fn), None
        if compile_max_bs:
            # NOTE: as DecodeGraphRunner: graph breaks at the Triton launchers; one compile per batch size
            allow_recompiles(spec.model.num_kv_layers, sum(b <= compile_max_bs for b in self.batch_sizes))
            make_compile_opaque()
            compiled = (torch.compile(spec.target_fn, dynamic=False), torch.compile(spec.draft_fn, dynamic=False))
        s, k, tree = spec.steps, spec.steps + 1, spec.topk > 1
        width = slots_per_step(s, spec.topk, spec.num_draft)              # slots per request of a step
        n = self.batch_sizes[-1]
        self.dummy_req = dummy_req
        self.pad_req = dummy_req if pad_mask_on() else None         # set on the spec inside `_fns`
        req_to_token[dummy_req, : width + 2] = 0
        self.rows = torch.full((n,), dummy_req, dtype=torch.int64, device=device)
        self.base = torch.ones(n, dtype=torch.int64, device=device)
        self.slots = torch.zeros(n, width, dtype=torch.int64, device=device)
        self.target = torch.zeros(n, spec.num_draft, dtype=torch.int64, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.cuda.CUDAGraph]] = {}
        self.outputs: dict[int, tuple] = {}
        self.fns: dict[int, tuple] = {}               # capture=False: the padded (first, second) run eagerly
        heads = spec.model.num_local_heads
        t0 = time.monotonic()
        for bs in reversed(self.batch_sizes):
            queries = query_counts(s, spec.topk, spec.num_draft) if tree else [1] * s + [k, s]
            counts = [[bs * q] * dp_size for q in queries] if dp_size else None
            kinds = queries if tree else (1, k, s)
            splits = [choose_num_kv_splits(decode_programs(bs, q * heads), max_context) for q in kinds]
            self.fns[bs] = self._padded(bs, tree, splits, counts)
        self.eager, self.compiled = eager, compiled
        if capture:
            self._capture()
            logger.info("captured %d speculative draft + verify CUDA graph pairs (bs %s) in %.1f s", len(self.graphs),
                        self.batch_sizes, time.monotonic() - t0)
        elif warm:
            for bs in reversed(self.batch_sizes):         # padding rows only: torch.compile and Triton compile here
                with self._fns(bs):
                    d, _, h = self.fns[bs][0](self._base_cpu(bs))
                    self.fns[bs][1](d, h, self._base_cpu(bs))
            if device.type == "cuda":
                torch.cuda.synchronize()
            logger.info("compiled %d eager speculative step sizes (bs %s) in %.1f s", len(self.batch_sizes),
                        self.batch_sizes, time.monotonic() - t0)

    @contextlib.contextmanager
    def _fns(self, cbs: int):
        """A padded size-cbs step (captured or run eagerly): the target and draft forwards compiled up to
        compile_max_bs, the padding request's rows routed to no expert (`SpecDecoder._decode_ctx`); eager calls
        outside (batches past the graphs) keep the plain forwards and no mask."""
        spec = self.spec
        if self.compiled is not None and cbs <= self.compile_max_bs:
            spec.target_fn, spec.draft_fn = self.compiled
        spec.pad_req = self.pad_req
        try:
            yield
        finally:
            spec.target_fn, spec.draft_fn = self.eager
            spec.pad_req = None

    def _padded(self, bs: int, tree: bool, splits: list[int], counts: list[list[int]] | None):
        """The two device functions of a size-bs step over the static buffers (`base_cpu`: the reference attention's
        host lengths; None inside graphs, where nothing reads them)."""
        spec = self.spec
        rows, base, slots, target = self.rows[:bs], self.base[:bs], self.slots[:bs], self.target[:bs]

        def first(base_cpu=None):
            if tree:
                t = draft_tree(spec, rows, base, slots, base_cpu, splits, counts)
                return (t, *verify_tree(spec, rows, base, slots, t, base_cpu, splits, counts))
            return spec.draft_verify(rows, base, slots, base_cpu, splits[:2], counts)

        def second(drafts, hidden, base_cpu=None):
            if tree:
                return accept_tree(spec, rows, base, slots, drafts, target, hidden, base_cpu, splits, counts)
            return spec.accept(rows, base, slots, drafts, target, hidden, base_cpu, splits[2],
                               counts[-1] if counts is not None else None)
        return first, second

    def _capture(self) -> None:
        pool, stream = None, torch.cuda.Stream()
        for bs in reversed(self.batch_sizes):
            first, second = self.fns[bs]
            with self._fns(bs):
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for _ in range(2):            # warm up: Triton (and torch.compile) compile here
                        d, _, h = first()
                        second(d, h)
                torch.cuda.current_stream().wait_stream(stream)
                g1, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
                with torch.cuda.graph(g1, pool=pool, stream=stream):
                    out1 = first()
                pool = g1.pool()
                with torch.cuda.graph(g2, pool=pool, stream=stream):
                    out2 = second(out1[0], out1[2])
            self.graphs[bs], self.outputs[bs] = (g1, g2), (out1, out2)
        torch.cuda.synchronize()

    def can_run(self, bs: int) -> bool:
        return bs <= self.batch_sizes[-1]

    def _size(self, bs: int) -> int:
        return self.batch_sizes[bisect.bisect_left(self.batch_sizes, bs)]

    def _base_cpu(self, cbs: int) -> list[int] | None:
        """capture=False: the padded bases on the host when the attention reads lengths there."""
        return self.base[:cbs].tolist() if self.spec.runner.attn_backend.host_seq_lens else None

    def draft_verify(self, rows: torch.Tensor, base: torch.Tensor, slots: torch.Tensor, pad_to: int | None = None):
        """`pad_to`: the captured size to replay (DP attention: the one all ranks agreed on; bs may be 0)."""
        bs = rows.shape[0]
        cbs = self._size(bs) if pad_to is None else pad_to
        assert bs <= cbs and cbs in self.fns, f"{bs} requests in the graph pair of size {cbs}"
        self.rows[:bs].copy_(rows)
        self.base[:bs].copy_(base)
        self.slots[:bs].copy_(slots)
        if cbs > bs:                              # padding rows: the dummy request, slot 0
            self.rows[bs:cbs].fill_(self.dummy_req)
            self.base[bs:cbs].fill_(1)
            self.slots[bs:cbs].zero_()
        self._bs, self._cbs = bs, cbs
        if self.captured:
            self.graphs[cbs][0].replay()
            drafts, logits, hidden = self.outputs[cbs][0]
        else:
            with self._fns(cbs):
                self._out1 = self.fns[cbs][0](self._base_cpu(cbs))
            drafts, logits, hidden = self._out1
        k = self.target.shape[1]                  # tokens verified per request
        drafts = DraftTree(*(x[:bs] for x in drafts)) if isinstance(drafts, DraftTree) else drafts[:bs]
        return drafts, logits[: bs * k], hidden[: bs * k]

    def accept(self, target: torch.Tensor):
        """Accepted drafts [B] (a chain), or (accepted [B], path [B, S + 1]) (a tree)."""
        bs, cbs = self._bs, self._cbs
        self.target[:bs].copy_(target)
        if self.captured:
            self.graphs[cbs][1].replay()
            out = self.outputs[cbs][1]
        else:
            with self._fns(cbs):
                out = self.fns[cbs][1](self._out1[0], self._out1[2], self._base_cpu(cbs))
        return tuple(x[:bs] for x in out) if isinstance(out, tuple) else out[:bs]
