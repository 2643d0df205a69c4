"""MTP speculative decoding (DESIGN.md sec. 7): the checkpoint's NextN layer drafts a chain of `S` tokens, one
target forward verifies them, and every request advances by 1 .. S + 1 tokens per step.

Legend: `B` requests, `S` draft steps, `k = S + 1` tokens verified per request, `h` hidden size, `V` vocab.

Where the draft's latent KV lives (the pool's layer `num_hidden_layers`, the NextN layer's own): the NextN input
that pairs token p with the target's final hidden state at position p - 1 is written to token p's slot, at rope
position p - 1 (the MTP sequence is the token sequence shifted by one; its attention reads `req_to_token[:, 1:]`).
So the draft KV in a slot depends only on the tokens up to that slot's token, exactly like the target's, and the
radix cache can share both: a cache hit costs no acceptance. Token 0's slot holds no draft pair.

One step (`SpecDecoder.step`), on the device:
  draft   S NextN decodes: (last token, target hidden at L - 1) -> d_1, then (d_j, the draft's own hidden) -> d_j+1
  verify  one target forward over [last token, d_1 .. d_S] at positions L .. L + S (causal, `num_q = k`)
  accept  the target's own token at each position (argmax, or the request's seeded sampler at the token's index);
          d_j is accepted while it equals the target's token before it, so the output is exactly what decoding
          without speculation would give, token for token, greedy or sampled
  repair  the draft pairs of the accepted drafts are rewritten with the target's hidden states (the draft wrote
          them with its own): one NextN forward over all S drafts (`num_q = S`; the rejected ones' slots are
          freed, so what lands there is moot). Every step is device work of fixed shape, so on the GPU the
          draft + verify and the accept + repair run as two CUDA graphs (`engine/graph.py`)
Tree drafts (topk > 1, `engine/spec_tree.py`) replace the draft, verify and accept parts: a tree of N tokens
verified with a tree mask, its accepted path's KV moved to consecutive slots; the target's tokens and the outputs
are picked here for both (a chain is the tree whose nodes are d_1 .. d_S in a line).
Prefill: after the target's extend the NextN layer extends over the same tokens (pairs for all but the first
token of each request). A request extending from a cached prefix p > 0 recomputes token p - 1 in the target
(its KV goes to the scratch slot 0; the cached copy stays) to get the hidden state its first pair needs.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from mlaserve.core import Batch, ForwardContext, ForwardMode
from mlaserve.engine import spec_tree
from mlaserve.engine.forward_batch import build_context, upload_ints
from mlaserve.kernels.mla_decode import choose_num_kv_splits, decode_programs
from mlaserve.kernels.sampling import greedy_ids
from mlaserve.kvcache.allocator import to_device
from mlaserve.layers.sampler import SamplingBatch

if TYPE_CHECKING:
    from mlaserve.engine.engine import ModelRunner

SCRATCH_SLOT = 0     # the padding slot: KV written here is never read


class SpecOutput(NamedTuple):
    """Per request of a verify step: the tokens it advances by (1 .. S + 1) and their log-probs when asked."""

    tokens: list[list[int]]
    logprobs: list[list[float] | None]
    top: list[list[list[tuple[float, int]]] | None]
    accepted: list[int]                      # drafts accepted (len(tokens) - 1)


class PendingSpec(NamedTuple):
    """A speculative step queued on the device (`SpecDecoder.launch`): its results arrive in host buffers at
    `event`. tokens [B, N] (the accepted path's first), accepted [B], logprobs [B, N] | None, top | None."""

    batch: Batch
    tokens: torch.Tensor
    accepted: torch.Tensor
    logprobs: torch.Tensor | None
    top: tuple[torch.Tensor, torch.Tensor] | None
    event: "torch.cuda.Event | None"


class Widened(NamedTuple):
    """An extend batch with, for each request extending from p > 0, token p - 1 recomputed in front."""

    ids: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    out_slots: torch.Tensor                  # [T'] host
    index: torch.Tensor                      # [T] host: position in T' of each token of the original batch


def widen(batch: Batch) -> Widened:
    ids, prefix, ext, slots, index = [], [], [], [], []
    at = 0
    for req, p, n, s in zip(batch.reqs, batch.prefix_lens, batch.extend_lens, _split(batch.out_slots, batch.extend_lens)):
        extra = 1 if p > 0 else 0
        ids.extend(req.fill_ids[p - extra: p + n])
        prefix.append(p - extra)
        ext.append(n + extra)
        if extra:
            slots.append(torch.tensor([SCRATCH_SLOT], dtype=torch.int64))
        slots.append(s)
        index.extend(range(at + extra, at + extra + n))
        at += extra + n
    return Widened(ids, prefix, ext, torch.cat(slots) if slots else batch.out_slots,
                   torch.tensor(index, dtype=torch.int64))


def slot_counts(batch: Batch, steps: int, topk: int = 1, num_draft: int | None = None) -> list[int]:
    """Tokens of each forward a step runs, in order: the S drafts, the target, the draft layer, and the draft layer
    again for a mixed batch's decodes (their repair, after its prompts' draft-layer extend). DP attention agrees on
    these, so every group runs every forward some group runs: IDLE where it has none."""
    queries = spec_tree.query_counts(steps, topk, num_draft) if topk > 1 else [1] * steps + [steps + 1, steps]
    if batch.mode is ForwardMode.DECODE:
        return [batch.size * q for q in queries] + [0]
    if batch.mode is ForwardMode.EXTEND:
        n = batch.num_decode
        heads = zip(batch.prefix_lens[: batch.size - n], batch.extend_lens[: batch.size - n])
        wide = [e + (1 if p > 0 else 0) for p, e in heads]
        pairs = sum(wide) - len(wide)
        if not n:
            return [0] * steps + [sum(wide), pairs, 0]
        return [n * q for q in queries[:steps]] + [sum(wide) + n * queries[steps], pairs, n * queries[-1]]
    return [0] * (steps + 3)


def _split(t: torch.Tensor, lens: list[int]) -> list[torch.Tensor]:
    return list(torch.split(t, lens)) if lens else []


class SpecDecoder:
    """Draft-and-verify for one rank's `ModelRunner` (whose model was built with its NextN layer)."""

    def __init__(self, runner: "ModelRunner", num_steps: int, topk: int = 1, num_draft: int | None = None):
        self.runner, self.steps = runner, num_steps
        self.topk = topk                                  # > 1: tree drafts (engine/spec_tree.py)
        self.num_draft = num_draft or num_steps + 1       # N: tokens verified per request, the root included
        self.model = runner.model
        assert self.model.mtp is not None, "the model was built without its NextN layer"
        # the target and the draft as the decode steps call them (torch.compile'd by SpecGraphRunner when asked)
        self.target_fn, self.draft_fn = self.model, self.model.mtp
        self.pad_req: int | None = None    # inside a padded graph step (SpecGraphRunner._fns): the padding request
        self.hidden_buf: torch.Tensor | None = None       # [rows, h]: target hidden at each request's last KV position
        self.base_buf: torch.Tensor | None = None         # [rows] int64: each request's tokens with KV (its next L)
        self.step_cols: torch.Tensor | None = None        # [slots_per_step] a step's columns past each base
        self.graphs = None                                # SpecGraphRunner (engine/graph.py) on the GPU

    def attach(self, rows: int) -> None:
        cfg = self.runner.cfg
        self.hidden_buf = torch.zeros(rows, cfg.hidden_size, dtype=self.runner.dtype, device=self.runner.device)
        self.base_buf = torch.zeros(rows, dtype=torch.int64, device=self.runner.device)
        # a step's table columns past each base: L .. L + slots_per_step - 1
        self.step_cols = torch.arange(spec_tree.slots_per_step(self.steps, self.topk, self.num_draft),
                                      device=self.runner.device)

    def _ctx(self, mode: ForwardMode, rows: list[int], prefix: list[int], ext: list[int], out_slots: torch.Tensor,
             draft: bool, num_q: int = 1):
        r = self.runner
        table = r.req_to_token[:, 1:] if draft else r.req_to_token    # the draft sequence starts at token 1
        return build_context(mode, req_pool_idx=rows, prefix_lens=prefix, extend_lens=ext, out_slots=out_slots,
                             req_to_token=table, kv_pool=r.pool, attn_backend=r.attn_backend, device=r.device,
                             num_q=num_q, last_token_logits=False)

    # --- prefill --------------------------------------------------------------------------------
    def idle(self, slots: list[list[int]], target=None) -> None:
        """DP attention: this group's part in the forwards of a step it has no tokens in (slots [forward][group]:
        the S drafts, the target, the draft layer (twice: `slot_counts`); a forward no group has tokens in is
        skipped by every group).
        `target(counts)`: its part in the target's forward (default: the model's IDLE forward; the runner passes
        the piecewise graphs' padding-only run when the ranks agreed on them)."""
        for i, counts in enumerate(slots):
            if not any(counts):
                continue
            if i == self.steps:
                (target or self.model.forward_idle)(counts)
            else:
                self.model.mtp.forward_idle(counts)

    def idle_repair(self, counts: list[int] | None) -> None:
        """DP attention: this group's part in the last forward of a step (`slot_counts`), another group's mixed-batch
        repair, when it has none (a plain decode or extend)."""
        if counts is not None and any(counts):
            self.model.mtp.forward_idle(counts)

    def after_extend(self, batch: Batch, wide: Widened, hidden: torch.Tensor, counts: list[int] | None = None) -> None:
        """The NextN layer over an extend batch the target just ran (`hidden` [T', h] of the widened batch):
        a draft pair for every token of each request but its first; each request's last hidden state is kept.
        `counts`: DP attention's agreed tokens of this forward per group."""
        rows, prefix, ext, take_tok, take_hid, last = [], [], [], [], [], []
        at = 0
        for req, p, n in zip(batch.reqs, wide.prefix_lens, wide.extend_lens):
            last.append(at + n - 1)
            if n > 1:
                rows.append(req.req_pool_idx)
                prefix.append(p)               # pairs for tokens p + 1 .. p + n - 1: draft positions p .. p + n - 2
                ext.append(n - 1)
                take_tok.extend(range(at + 1, at + n))
                take_hid.extend(range(at, at + n - 1))
            at += n
        out_slots = wide.out_slots[torch.tensor(take_tok, dtype=torch.int64)] if take_tok else None
        dev = self.runner.device
        if rows:
            ids = torch.tensor(wide.ids, dtype=torch.int64)[take_tok].to(dev)
            ctx = self._ctx(ForwardMode.EXTEND, rows, prefix, ext, out_slots, draft=True)
            ctx.logits_indices = torch.empty(0, dtype=torch.int64, device=dev)
            ctx.global_num_tokens = counts
            self.model.mtp(ids, hidden[to_device(torch.tensor(take_hid), dev)], ctx.positions, ctx)
        elif counts is not None and any(counts):
            self.model.mtp.forward_idle(counts)
        req_rows = to_device(torch.tensor([r.req_pool_idx for r in batch.reqs], dtype=torch.int64), dev)
        self.hidden_buf[req_rows] = hidden[to_device(torch.tensor(last, dtype=torch.int64), dev)]
        ends = [p + n for p, n in zip(batch.prefix_lens, batch.extend_lens)]
        self.base_buf[req_rows] = to_device(torch.tensor(ends, dtype=torch.int64), dev)

    # --- one decode step: draft, verify, accept, repair -------------------------------------------
    @torch.no_grad()
    def step(self, batch: Batch, draft_bitmask=None) -> SpecOutput:
        return self.resolve(self.launch(batch, draft_bitmask))

    @torch.no_grad()
    def launch(self, batch: Batch, draft_bitmask=None) -> "PendingSpec":
        """Queue a step on the device and return without waiting (`resolve` fetches its tokens). Each request's
        base L (tokens with KV) is read on the device (`base_buf`, advanced by every accept), its step's slots from
        its req_to_token row at columns L .. L + slots_per_step - 1: so the next step can be queued before this
        one's accept lengths reach the host (the overlap scheduler). The host's `batch.prefix_lens` may then be
        lower bounds of L (`scheduler/decode.plan_decode`); nothing here reads them as exact.
        `draft_bitmask` (structured output) walks the drafts on the host: it waits for them."""
        b, dev = batch.size, self.runner.device
        rows = to_device(torch.tensor([q.req_pool_idx for q in batch.reqs], dtype=torch.int64), dev)
        base = self.base_buf[rows]                                       # L: tokens with KV before
        cols = base[:, None] + self.step_cols
        slots = self.runner.req_to_token[rows[:, None], cols].to(torch.int64)    # token L + j -> slots[:, j]
        # NOTE: the PyTorch reference attention reads lengths on the host (a wait that costs nothing on the CPU)
        base_cpu = base.tolist() if self.runner.attn_backend.host_seq_lens else None
        # DP attention: the graph pair of the size every rank agreed on (an IDLE batch: padding rows only), or eager
        dp = self.runner.group.dp is not None
        graphs = self.graphs if self.graphs is not None and (batch.graph_bs is not None if dp else
                                                              self.graphs.can_run(b)) else None
        pad = batch.graph_bs
        counts = batch.slot_tokens                                       # DP attention: [forward][group]
        extra = None                      # DP attention: another group's mixed batch repairs after its draft layer
        if counts is not None:
            counts, extra = counts[: self.steps + 2], counts[self.steps + 2]
        if self.topk > 1 and graphs is not None:
            tree, logits, hidden = graphs.draft_verify(rows, base, slots, pad)
        elif self.topk > 1:
            tree = spec_tree.draft_tree(self, rows, base, slots, base_cpu, counts=counts)
            logits, hidden = spec_tree.verify_tree(self, rows, base, slots, tree, base_cpu, counts=counts)
        else:
            root = self.runner.token_buf[rows]
            if graphs is not None:
                draft_ids, logits, hidden = graphs.draft_verify(rows, base, slots, pad)
            else:
                draft_ids, logits, hidden = self.draft_verify(rows, base, slots, base_cpu, counts=counts)
            tree = spec_tree.chain_tree(root, draft_ids)
        mask = draft_bitmask(spec_tree.paths(tree)) if draft_bitmask is not None else None   # grammars: host walk
        target, lp, top = self._target_tokens(batch, base, logits, tree, mask)    # [B, N]
        if self.topk > 1 and graphs is not None:
            accepted, path = graphs.accept(target)
        elif self.topk > 1:
            accepted, path = spec_tree.accept_tree(self, rows, base, slots, tree, target, hidden, base_cpu,
                                                   counts=counts)
        else:
            if graphs is not None:
                accepted = graphs.accept(target)
            else:
                accepted = self.accept(rows, base, slots, draft_ids, target, hidden, base_cpu,
                                       counts=counts[-1] if counts is not None else None)
            path = None                                   # a chain's nodes are its path, in order
        self.idle_repair(extra)
        self.base_buf[rows] = base + 1 + accepted
        if path is not None:                              # the accepted path's nodes first
            target, lp, top = _along(path, target, lp, top)
        return _pending(batch, target, accepted, lp, top)

    # --- the decodes of a mixed batch (--enable-mixed-chunk): drafts before its target forward, accept after -------
    def mixed_drafts(self, batch: Batch, counts: list[list[int]] | None = None) -> "MixedTail":
        """The last `batch.num_decode` requests of a mixed extend batch decode this step: their drafts (a chain, or
        a tree with topk > 1), made before the batch's target forward verifies them in its last rows (each
        request's N nodes at positions L + depth, causal or under the tree mask, over its KV), at its base L =
        `batch.prefix_lens`, exact on the host (`scheduler/prefill.plan_prefill` drained the step before).
        `counts`: DP attention's agreed tokens of the S draft forwards per group."""
        r, n = self.runner, batch.num_decode
        reqs, prefix = batch.reqs[-n:], batch.prefix_lens[-n:]
        k = batch.extend_lens[-1]                                       # slots_per_step, as in a decode batch
        dec = Batch(ForwardMode.DECODE, reqs, [], batch.out_slots[-n * k:], prefix, [k] * n, [True] * n)
        rows, base = upload_ints([[q.req_pool_idx for q in reqs], prefix], r.device)
        slots = r.req_to_token[rows[:, None], base[:, None] + self.step_cols].to(torch.int64)   # [n, k]
        base_cpu = list(prefix) if r.attn_backend.host_seq_lens else None
        heads, longest = self.model.num_local_heads, max(prefix)
        queries = spec_tree.query_counts(self.steps, self.topk, self.num_draft)[: self.steps]
        splits = [choose_num_kv_splits(decode_programs(n, q * heads), longest + q) for q in queries]
        if self.topk > 1:
            tree = spec_tree.draft_tree(self, rows, base, slots, base_cpu, splits + [None, None], counts)
            draft_ids = None
        else:
            draft_ids = self.draft(rows, base, slots, base_cpu, splits[0], counts)
            tree = spec_tree.chain_tree(r.token_buf[rows], draft_ids)
        return MixedTail(dec, rows, base, base_cpu, slots, draft_ids, tree)

    def mixed_accept(self, tail: "MixedTail", logits: torch.Tensor, hidden: torch.Tensor,
                     counts: list[int] | None = None) -> PendingSpec:
        """The accept of a mixed batch's decodes from their rows of its target forward (logits [n N, V], hidden
        [n N, h]): what `launch` does after its verify, queued on the device likewise. `counts`: DP attention's
        agreed tokens of the repair per group."""
        target, lp, top = self._target_tokens(tail.batch, tail.base, logits, tail.tree)
        n, path = tail.rows.shape[0], None
        repair = choose_num_kv_splits(decode_programs(n, self.steps * self.model.num_local_heads),
                                      max(tail.batch.prefix_lens) + self.steps)
        if self.topk > 1:
            accepted, path = spec_tree.accept_tree(self, tail.rows, tail.base, tail.slots, tail.tree, target, hidden,
                                                   tail.base_cpu, [repair], [counts] if counts is not None else None)
        else:
            accepted = self.accept(tail.rows, tail.base, tail.slots, tail.draft_ids, target, hidden, tail.base_cpu,
                                   repair, counts)
        self.base_buf[tail.rows] = tail.base + 1 + accepted
        if path is not None:                              # the accepted path's nodes first
            target, lp, top = _along(path, target, lp, top)
        return _pending(tail.batch, target, accepted, lp, top)

    def resolve(self, p: "PendingSpec") -> SpecOutput:
        """The tokens of a step queued by `launch` (waits for it)."""
        if p.event is not None:
            p.event.synchronize()
        n_acc = p.accepted.tolist()
        tokens = p.tokens.tolist()
        lps = p.logprobs.tolist() if p.logprobs is not None else None
        tops = [t.tolist() for t in p.top] if p.top is not None else None
        out_tokens, out_lp, out_top = [], [], []
        for i, req in enumerate(p.batch.reqs):
            n = n_acc[i] + 1
            out_tokens.append(tokens[i][:n])
            out_lp.append(lps[i][:n] if lps is not None and req.return_logprob else None)
            kk = req.top_logprobs_num
            out_top.append([list(zip(tops[0][i][j][:kk], tops[1][i][j][:kk])) for j in range(n)]
                           if tops is not None and req.return_logprob and kk else None)
        return SpecOutput(out_tokens, out_lp, out_top, n_acc)

    def _decode_ctx(self, rows: torch.Tensor, seq_lens: torch.Tensor, positions: torch.Tensor,
                    out_slots: torch.Tensor, num_q: int, draft: bool, seq_cpu: list[int] | None,
                    splits: int | None, counts: list[int] | None = None) -> ForwardContext:
        """A DECODE context from device tensors only (so CUDA graphs can capture it); `seq_cpu` are the same
        lengths on the host for the reference attention (None under graphs, where nothing reads them). With the
        graphs' padding request known (`pad_req`) its rows (num_q per request) route to no expert in the MoE;
        under DP attention (`counts`) every row routes."""
        r = self.runner
        b = rows.shape[0]
        mask = None
        if self.pad_req is not None and counts is None and b > 1:
            mask = (rows != self.pad_req)[:, None].expand(b, num_q).reshape(-1)            # [b * num_q]
        return ForwardContext(
            mode=ForwardMode.DECODE, positions=positions, out_slots=out_slots, req_pool_idx=rows,
            seq_lens=seq_lens.to(torch.int32), seq_lens_cpu=seq_cpu if seq_cpu is not None else [num_q] * b,
            extend_lens_cpu=[num_q] * b, req_to_token=r.req_to_token[:, 1:] if draft else r.req_to_token,
            kv_pool=r.pool, attn_backend=r.attn_backend, num_q=num_q, logits_indices=None, num_kv_splits=splits,
            global_num_tokens=counts, moe_row_mask=mask)

    def draft_verify(self, rows: torch.Tensor, base: torch.Tensor, slots: torch.Tensor,
                     base_cpu: list[int] | None, splits: tuple[int, int] | None = None,
                     counts: list[list[int]] | None = None):
        """S draft steps, then the target over [last token, d_1 .. d_S]: (drafts [B, S], logits [B * k, V],
        hidden [B * k, h]). Device work only (`base_cpu` feeds the reference attention; `counts`: DP attention's
        agreed tokens per forward and group)."""
        draft_ids = self.draft(rows, base, slots, base_cpu, splits and splits[0], counts)
        return (draft_ids, *self.verify(rows, base, slots, draft_ids, base_cpu, splits and splits[1],
                                        counts[self.steps] if counts is not None else None))

    def draft(self, rows: torch.Tensor, base: torch.Tensor, slots: torch.Tensor, base_cpu: list[int] | None,
              splits: int | None = None, counts: list[list[int]] | None = None) -> torch.Tensor:
        """The chain of S drafts [B, S]: step j pairs token L + j with hidden L + j - 1 at draft position
        L + j - 1 (the target's hidden for j = 0, the draft's own after)."""
        tok, hid, drafts = self.runner.token_buf[rows], self.hidden_buf[rows], []
        for j in range(self.steps):
            pos = base + (j - 1)
            cpu = [x + j for x in base_cpu] if base_cpu is not None else None
            ctx = self._decode_ctx(rows, base + j, pos, slots[:, j], 1, True, cpu, splits,
                                   counts[j] if counts is not None else None)
            out = self.draft_fn(tok, hid, pos, ctx)
            tok, hid = self.model.mtp.to_vocab(out.logits.argmax(-1)), out.hidden
            drafts.append(tok)
        return torch.stack(drafts, dim=1)

    def verify(self, rows: torch.Tensor, base: torch.Tensor, slots: torch.Tensor, draft_ids: torch.Tensor,
               base_cpu: list[int] | None, splits: int | None = None,
               counts: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The target over [token L, d_1 .. d_S] at positions L .. L + S: (logits [B * k, V], hidden [B * k, h])."""
        k = self.steps + 1
        ids = torch.cat([self.runner.token_buf[rows][:, None], draft_ids], dim=1).reshape(-1)     # [B * k]
        pos = (base[:, None] + torch.arange(k, device=base.device)).reshape(-1)
        cpu = [x + k for x in base_cpu] if base_cpu is not None else None
        ctx = self._decode_ctx(rows, base + k, pos, slots.reshape(-1), k, False, cpu, splits, counts)
        out = self.target_fn(ids, pos, ctx)
        return out.logits, out.hidden

    def accept(self, rows: torch.Tensor, base: torch.Tensor, slots: torch.Tensor, draft_ids: torch.Tensor,
               target: torch.Tensor, hidden: torch.Tensor, base_cpu: list[int] | None,
               splits: int | None = None, counts: list[int] | None = None) -> torch.Tensor:
        """Accepted drafts per request [B] (leading drafts equal to the target's token before them); repairs
        their draft pairs and leaves each request's newest token and hidden state in the runner's buffers."""
        s, b = self.steps, rows.shape[0]
        accepted = (draft_ids == target[:, :s]).to(torch.int64).cumprod(dim=1).sum(dim=1)
        hidden = hidden.view(b, s + 1, -1)
        # repair: pairs (d_j, target hidden L + j - 1), j = 1 .. S, at draft positions L .. L + S - 1
        pos = (base[:, None] + torch.arange(s, device=base.device)).reshape(-1)
        cpu = [x + s for x in base_cpu] if base_cpu is not None else None
        ctx = self._decode_ctx(rows, base + s, pos, slots[:, 1:].reshape(-1), s, True, cpu, splits, counts)
        ctx.logits_indices = torch.empty(0, dtype=torch.int64, device=base.device)
        self.draft_fn(draft_ids.reshape(-1), hidden[:, :s].reshape(b * s, -1), pos, ctx)
        pick = torch.arange(b, device=base.device)
        self.hidden_buf[rows] = hidden[pick, accepted]
        self.runner.token_buf[rows] = target[pick, accepted]
        return accepted

    def _target_tokens(self, batch: Batch, base: torch.Tensor, logits: torch.Tensor, tree: spec_tree.DraftTree,
                       bitmask: torch.Tensor | None = None):
        """The target's token at every verified node (logits [B * N, V]): what decoding without speculation
        samples there if the drafts on its path are accepted (its step index, and those drafts as output history).
        A node's step index is computed on the device from the request's base L (`base` [B]); the host's
        `batch.prefix_lens` give lower bounds only (enough to tell whether a sampler is needed at all).
        Returns (tokens [B, N], log-probs [B, N] | None, top (values, ids) [B, N, n] | None)."""
        r = self.runner
        b, n = tree.tokens.shape
        reqs = batch.reqs
        first = [r._step_index(batch, i) for i in range(b)]         # lower bounds (exact without overlap)
        if bitmask is None and r._plain_greedy(reqs, first):      # NOTE: a node's step is >= its request's first
            return greedy_ids(logits, r.sampler.use_triton).view(b, n), None, None
        expanded = [q for q in reqs for _ in range(n)]
        sb = SamplingBatch.build([q.params for q in expanded], [q.seed for q in expanded],
                                 [f for f in first for _ in range(n)], [q.input_ids for q in expanded],
                                 [q.output_ids for q in expanded], r.cfg.vocab_size, r.eos_ids(), r.device)
        prompt = to_device(torch.tensor([len(q.input_ids) for q in reqs], dtype=torch.int64), r.device)
        sb.steps = ((base - prompt + 1)[:, None] + tree.depth).reshape(-1)   # output tokens before each node
        if sb.need_penalties:
            _add_draft_history(sb, tree)
        if bitmask is not None:
            sb.token_bitmask = to_device(bitmask, r.device)
        want_lp = any(q.return_logprob for q in reqs)
        n_top = max(q.top_logprobs_num for q in reqs)
        out = r.sampler(logits, sb, return_logprob=want_lp, top_logprobs_num=n_top if want_lp else 0)
        lp = out.logprobs.view(b, n) if out.logprobs is not None else None
        top = tuple(t.view(b, n, -1) for t in out.top_logprobs) if out.top_logprobs is not None else None
        return out.next_ids.view(b, n), lp, top


class MixedTail(NamedTuple):
    """The decodes of a mixed batch between their drafts and their accept (`SpecDecoder.mixed_drafts`)."""

    batch: Batch                             # the decodes alone, as a DECODE batch
    rows: torch.Tensor                       # [n] pool rows (device)
    base: torch.Tensor                       # [n] each one's base L (device)
    base_cpu: list[int] | None               # the same on the host, for the reference attention
    slots: torch.Tensor                      # [n, k] the step's slots (`spec_tree.slots_per_step`)
    draft_ids: torch.Tensor | None           # [n, S] a chain's drafts (None for a tree)
    tree: spec_tree.DraftTree                # the N verified nodes of each (a chain: its last token, its drafts)


def _along(path: torch.Tensor, target: torch.Tensor, lp: torch.Tensor | None,
           top: tuple[torch.Tensor, torch.Tensor] | None):
    """A tree step's per-node results [B, N, ...] along the accepted path's nodes [B, S + 1]."""
    lp = lp.gather(1, path) if lp is not None else None
    top = tuple(t.gather(1, path[:, :, None].expand(-1, -1, t.shape[2])) for t in top) if top is not None else None
    return target.gather(1, path), lp, top


def _pending(batch: Batch, target: torch.Tensor, accepted: torch.Tensor, lp: torch.Tensor | None,
             top: tuple[torch.Tensor, torch.Tensor] | None) -> PendingSpec:
    """A step's results copied to the host without waiting, with the event they are ready at."""
    host = [t.to("cpu", non_blocking=True) if t is not None else None for t in (target, accepted, lp)]
    top = tuple(t.to("cpu", non_blocking=True) for t in top) if top is not None else None
    event = None
    if target.device.type == "cuda":
        event = torch.cuda.Event()
        event.record()
    return PendingSpec(batch, host[0], host[1], host[2], top, event)


def _add_draft_history(sb: SamplingBatch, tree: spec_tree.DraftTree) -> None:
    """Row (b, m) of a verify batch samples after the drafts on node m's path were output: count them as
    output history."""
    b, n = tree.tokens.shape
    drafts = tree.tokens[:, 1:]                                          # [B, N - 1]
    seen = torch.zeros(b, n, sb.vocab_size, dtype=torch.int32, device=drafts.device)
    seen.scatter_add_(2, drafts[:, None, :].expand(b, n, n - 1), spec_tree.history(tree))
    seen = seen.view(b * n, sb.vocab_size)
    if sb.token_counts is not None:
        sb.token_counts = sb.token_counts + seen
    if sb.seen_mask is not None:
        sb.seen_mask = sb.seen_mask | (seen > 0)
