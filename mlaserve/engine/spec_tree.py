"""Tree drafts for speculative decoding (`--speculative-eagle-topk K > 1`, EAGLE-2 style): the NextN layer expands
the top-K children of each of the K best frontier nodes per step, the best `N - 1` candidates by cumulative draft
log-probability become the tree, and the target verifies all N nodes (the root is the last token) in one forward
with a tree mask. The accepted path is compacted to consecutive slots, so the scheduler keeps its
"KV up to the last kept token" accounting.

Legend: `B` requests, `S` draft steps, `K` topk, `N` tree nodes (num_draft_tokens, root included), `C` candidates
(K + (S - 1) K^2), `n` draft queries of a step, `h` hidden size, `V` vocab.

Slots of one step, request by request (columns of its req_to_token row from L, its tokens with KV before):
    col  L            L + 1 ....................................  L + slots_per_step - 1
    target layers: tree node m at col L + m (m < N); after acceptance, path node d at col L + d
    draft layer:   the root's pair | draft queries (frontier nodes of depths 1 .. S - 1, depth-major), then the
                   accepted path's pairs (repair, cols L + 1 .. L + S)
A tree lists parents before children, so every mask row's bits are its ancestors, itself and nothing after it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from mlaserve.engine.spec import SpecDecoder


class DraftTree(NamedTuple):
    """The verified nodes of every request (node 0: its last token, the root; parents listed first)."""

    tokens: torch.Tensor      # [B, N] int64
    parents: torch.Tensor     # [B, N] int64 node index of the parent (the root's: 0)
    depth: torch.Tensor       # [B, N] int64 tokens after the root (0 .. S)
    mask: torch.Tensor        # [B, N] int64 bit i: node i is an ancestor of the node or the node itself


def slots_per_step(steps: int, topk: int, num_draft: int) -> int:
    """KV slots a decode step takes per request: the verified nodes, the draft queries, the repaired pairs."""
    return max(num_draft, 1 + topk * (steps - 1), steps + 1)


def query_counts(steps: int, topk: int, num_draft: int) -> list[int]:
    """Queries per request of each forward of a step, in order: the S draft steps, the verify, the repair (CUDA
    graphs fix each one's kv splits)."""
    return [1] + [topk * i for i in range(1, steps)] + [num_draft, steps]


def chain_tree(root: torch.Tensor, drafts: torch.Tensor) -> DraftTree:
    """A chain (topk 1) as a tree: root [B], drafts [B, S]."""
    b, s = drafts.shape
    i = torch.arange(s + 1, device=drafts.device)
    return DraftTree(torch.cat([root[:, None], drafts], dim=1), (i - 1).clamp(min=0).expand(b, -1),
                     i.expand(b, -1), ((1 << (i + 1)) - 1).expand(b, -1))


def paths(tree: DraftTree) -> list[list[list[int]]]:
    """Host: [B][N] the draft tokens from depth 1 down to each node (empty for the root)."""
    toks, mask = tree.tokens.tolist(), tree.mask.tolist()
    n = len(toks[0]) if toks else 0
    return [[[t[i] for i in range(1, n) if (bits >> i) & 1] for bits in m] for t, m in zip(toks, mask)]


def history(tree: DraftTree) -> torch.Tensor:
    """[B, N, N - 1] int32: 1 where draft node i + 1 is output history for sampling at node m (on its path)."""
    i = torch.arange(1, tree.mask.shape[1], device=tree.mask.device)
    return ((tree.mask[:, :, None] >> i) & 1).to(torch.int32)


def expand(score: torch.Tensor, logp: torch.Tensor, topk: int):
    """One draft step: the top-K children of each of the K frontier nodes (score [B, K], logp [B, K, V]).
    Returns candidates (tokens, scores [B, K * K]) and the next frontier's (indices into them [B, K])."""
    child_lp, child_tok = logp.topk(topk, dim=-1)                         # [B, K, K]
    cand_score = (score[:, :, None] + child_lp).flatten(1)               # [B, K * K] cumulative log-prob
    best = cand_score.topk(topk, dim=-1).indices                          # [B, K]
    return child_tok.flatten(1), cand_score, best


def select(tokens: torch.Tensor, scores: torch.Tensor, parents: torch.Tensor, depth: torch.Tensor,
           root: torch.Tensor, num_draft: int, steps: int) -> DraftTree:
    """The tree: the root and the best N - 1 candidates (tokens, scores, parents (candidate index, -1: the root),
    depth [B, C]). NOTE: a child's score is its parent's plus a log-prob <= 0 and it comes later in C, so a
    stable descending sort keeps every chosen node's parent chosen; taken back in candidate order, parents
    come first."""
    b, c = scores.shape
    dev = scores.device
    chosen = scores.sort(dim=1, descending=True, stable=True).indices[:, : num_draft - 1].sort(dim=1).values
    node_of = torch.zeros(b, c + 1, dtype=torch.int64, device=dev)       # candidate (shifted by 1) -> node
    node_of.scatter_(1, chosen + 1, torch.arange(1, num_draft, device=dev).expand(b, -1))
    par = node_of.gather(1, parents.gather(1, chosen) + 1)               # [B, N - 1]; the root -> column 0 -> 0
    zero = torch.zeros(b, 1, dtype=torch.int64, device=dev)
    par = torch.cat([zero, par], dim=1)
    dep = torch.cat([zero, depth.gather(1, chosen)], dim=1)
    bits = 1 << torch.arange(num_draft, device=dev).expand(b, -1)
    mask = bits
    for _ in range(steps):                                                # one more ancestor level each time
        mask = bits | torch.where(dep > 0, mask.gather(1, par), 0)
    return DraftTree(torch.cat([root[:, None], tokens.gather(1, chosen)], dim=1), par, dep, mask)


def accept_path(tree: DraftTree, target: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The longest path of nodes whose token is the target's token at their parent (target [B, N]).
    Returns (accepted drafts [B], path [B, S + 1]: node at depth d, the last accepted node past the path)."""
    b, n = tree.tokens.shape
    match = tree.tokens == target.gather(1, tree.parents)               # [B, N]
    root = torch.arange(n, device=target.device) == 0
    ok = root.expand(b, -1)
    for _ in range(steps):
        ok = root | (match & ok.gather(1, tree.parents))
    accepted = torch.where(ok, tree.depth, -1).max(dim=1)
    last = accepted.indices                                               # [B] deepest accepted node
    on_path = ((tree.mask.gather(1, last[:, None]) >> torch.arange(n, device=target.device)) & 1).bool()
    slot = torch.where(on_path, tree.depth, steps + 1)                  # off-path nodes land in a spare column
    path = torch.zeros(b, steps + 2, dtype=torch.int64, device=target.device)
    path.scatter_(1, slot, torch.arange(n, device=target.device).expand(b, -1))
    d = torch.arange(steps + 1, device=target.device)
    path = torch.where(d <= accepted.values[:, None], path[:, : steps + 1], last[:, None])
    return accepted.values, path


# --- the forwards ---------------------------------------------------------------------------------------
def draft_tree(dec: "SpecDecoder", rows: torch.Tensor, base: torch.Tensor, slots: torch.Tensor,
               base_cpu: list[int] | None, splits: list[int] | None = None,
               counts: list[list[int]] | None = None) -> DraftTree:
    """S NextN steps growing the tree. Step 0 runs the root's pair (as the chain's first step); step i >= 1
    runs every frontier node of depths 1 .. i (n = K i queries, each seeing its frontier ancestors through the
    tree mask: recomputing the earlier ones keeps every step one plain forward) and expands depth i's. Device
    work only (`base_cpu` feeds the reference attention; `splits`: kv splits per forward, `query_counts` order;
    `counts`: DP attention's agreed tokens per forward and group, the same order)."""
    k, s = dec.topk, dec.steps
    b, dev = rows.shape[0], rows.device
    root = dec.runner.token_buf[rows]
    cpu = list(base_cpu) if base_cpu is not None else None
    ctx = dec._decode_ctx(rows, base, base - 1, slots[:, 0], 1, True, cpu, splits and splits[0], counts and counts[0])
    out = dec.draft_fn(root, dec.hidden_buf[rows], base - 1, ctx)
    score, tok = out.logits.float().log_softmax(-1).topk(k, dim=-1)      # [B, K]: depth 1
    tok = dec.model.mtp.to_vocab(tok)
    hid = out.hidden[:, None, :].expand(b, k, -1)                          # [B, K, h] the pair's hidden
    front = torch.arange(k, device=dev).expand(b, -1)                     # frontier -> candidate index
    cands = ([tok], [score], [torch.full((b, k), -1, dtype=torch.int64, device=dev)],
             [torch.ones(b, k, dtype=torch.int64, device=dev)])
    q_tok, q_hid, q_bits = [], [], []
    up = torch.zeros(b, k, dtype=torch.int64, device=dev)                  # frontier's parent in the previous one
    for i in range(1, s):
        own = (1 << ((i - 1) * k + torch.arange(k, device=dev))).expand(b, -1)
        q_bits.append(own if i == 1 else own | q_bits[-1].gather(1, up))
        q_tok.append(tok)
        q_hid.append(hid)
        out = _draft_queries(dec, rows, base, slots, base_cpu, q_tok, q_hid, q_bits, splits and splits[i],
                             counts and counts[i])
        n = k * i
        logp = out.logits.float().log_softmax(-1).view(b, k, -1)          # [B, K, V] depth i's children
        c_tok, c_score, best = expand(score, logp, k)
        c_tok = dec.model.mtp.to_vocab(c_tok)
        offset = sum(x.shape[1] for x in cands[0])
        cands[0].append(c_tok)
        cands[1].append(c_score)
        cands[2].append(front.gather(1, torch.arange(k * k, device=dev).expand(b, -1) // k))
        cands[3].append(torch.full((b, k * k), i + 1, dtype=torch.int64, device=dev))
        up = best // k
        tok, score = c_tok.gather(1, best), c_score.gather(1, best)
        hid = out.hidden.view(b, n, -1)[:, n - k:].gather(1, up[:, :, None].expand(-1, -1, out.hidden.shape[-1]))
        front = offset + best
    t, sc, par, dep = (torch.cat(x, dim=1) for x in cands)
    return select(t, sc, par, dep, root, dec.num_draft, s)


def _draft_queries(dec: "SpecDecoder", rows, base, slots, base_cpu, q_tok, q_hid, q_bits, splits: int | None,
                   counts: list[int] | None):
    """The NextN layer over the frontier nodes so far (depth-major) at draft positions L + depth - 1, in draft
    table columns L .. L + n - 1 (slots[:, 1 : 1 + n]); logits of the deepest K only."""
    b, k = rows.shape[0], dec.topk
    n = k * len(q_tok)
    ids = torch.cat(q_tok, dim=1).reshape(-1)                              # [B * n]
    hid = torch.cat(q_hid, dim=1).reshape(b * n, -1)
    depth = torch.arange(n, device=rows.device) // k + 1
    pos = (base[:, None] + depth - 1).reshape(-1)
    cpu = [x + n for x in base_cpu] if base_cpu is not None else None
    ctx = dec._decode_ctx(rows, base + n, pos, slots[:, 1:1 + n].reshape(-1), n, True, cpu, splits, counts)
    ctx.tree_mask = torch.cat(q_bits, dim=1).reshape(-1)
    ctx.logits_indices = (torch.arange(b, device=rows.device)[:, None] * n + (n - k)
                          + torch.arange(k, device=rows.device)).reshape(-1)
    return dec.draft_fn(ids, hid, pos, ctx)


def verify_tree(dec: "SpecDecoder", rows, base, slots, tree: DraftTree, base_cpu: list[int] | None,
                splits: list[int] | None = None, counts: list[list[int]] | None = None):
    """The target over the N nodes at positions L + depth, cols L .. L + N - 1: (logits [B N, V], hidden)."""
    n = tree.tokens.shape[1]
    pos = (base[:, None] + tree.depth).reshape(-1)
    cpu = [x + n for x in base_cpu] if base_cpu is not None else None
    ctx = dec._decode_ctx(rows, base + n, pos, slots[:, :n].reshape(-1), n, False, cpu, splits and splits[-2],
                          counts and counts[-2])
    ctx.tree_mask = tree.mask.reshape(-1)
    out = dec.target_fn(tree.tokens.reshape(-1), pos, ctx)
    return out.logits, out.hidden


def accept_tree(dec: "SpecDecoder", rows, base, slots, tree: DraftTree, target: torch.Tensor,
                hidden: torch.Tensor, base_cpu: list[int] | None, splits: list[int] | None = None,
                counts: list[list[int]] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Accept the longest matching path; move its target KV to cols L .. L + S, repair its draft pairs there
    and leave the newest token and hidden state in the runner's buffers. Returns (accepted [B], path)."""
    s, b = dec.steps, rows.shape[0]
    accepted, path = accept_path(tree, target, s)
    # NOTE: path[d] >= d, and every source row is read before any is written (past the path: moot slots)
    src, dst = slots.gather(1, path), slots[:, : s + 1]
    dec.runner.pool.copy_rows(src[:, 1:].reshape(-1), dst[:, 1:].reshape(-1), dec.runner.cfg.num_hidden_layers)
    hidden = hidden.view(b, tree.tokens.shape[1], -1)
    hid_path = hidden.gather(1, path[:, :, None].expand(-1, -1, hidden.shape[-1]))     # [B, S + 1, h]
    # repair: pairs (path token d, target hidden at path d - 1), d = 1 .. S, draft positions L .. L + S - 1
    pos = (base[:, None] + torch.arange(s, device=base.device)).reshape(-1)
    cpu = [x + s for x in base_cpu] if base_cpu is not None else None
    ctx = dec._decode_ctx(rows, base + s, pos, dst[:, 1:].reshape(-1), s, True, cpu, splits and splits[-1],
                          counts and counts[-1])
    ctx.logits_indices = torch.empty(0, dtype=torch.int64, device=base.device)
    dec.draft_fn(tree.tokens.gather(1, path[:, 1:]).reshape(-1), hid_path[:, :s].reshape(b * s, -1), pos, ctx)
    pick = torch.arange(b, device=base.device)
    last = path[pick, accepted]
    dec.hidden_buf[rows] = hidden[pick, last]
    dec.runner.token_buf[rows] = target[pick, last]
    return accepted, path
