"""KV ownership for the scheduler: token slots, request rows and the radix prefix cache, in one place.

A request's slots (req_to_token row) are: the matched prefix, owned by the tree and locked while the
request runs, then its own slots. Finishing or retracting a request hands its computed KV to the tree.
"""
from __future__ import annotations

import torch

from mlaserve.core import Req
from mlaserve.kvcache.allocator import ReqToTokenPool, TokenSlotAllocator
from mlaserve.kvcache.radix import RadixCache


# A cached prefix shorter than this is not used: recomputing a few tokens costs next to nothing, while an extend with
# a cached prefix runs the MLA prefill's prefix path (the prefix's latent KV expanded through kv_b_proj and a second
# attention pass merged in, each layer), which cost a 200-token prompt 4-9 ms more on an H100 for a one-token hit
# (benchmarks/results/pdl-h100.md). Every text prompt starts with BOS, so without this each one took that path. A hit
# that leaves one token to compute is used whatever its length: that extend runs as a decode step.
MIN_PREFIX_HIT = 16


class KVCacheManager:
    def __init__(self, num_slots: int, max_reqs: int, max_context: int, *, disable_radix: bool,
                 device: torch.device | str = "cpu", min_prefix_hit: int = MIN_PREFIX_HIT):
        self.allocator = TokenSlotAllocator(num_slots)
        self.req_pool = ReqToTokenPool(max_reqs, max_context, device)
        self.tree = RadixCache(self.allocator, disable=disable_radix)
        self.num_slots = num_slots
        self.min_prefix_hit = min_prefix_hit

    @property
    def req_to_token(self) -> torch.Tensor:
        return self.req_pool.table

    def available(self) -> int:
        """Slots that can be had now: free plus evictable from the tree."""
        return self.allocator.available + self.tree.evictable_size

    def used(self) -> int:
        """Slots held by running requests or the tree (the pool usage users see)."""
        return self.num_slots - self.allocator.available

    def match(self, req: Req) -> tuple[torch.Tensor, object]:
        """Longest cached prefix usable for `req`: at most all but one token of fill_ids (the last token's
        logits are needed), and not past the first position whose prompt log-prob is wanted; none if that is
        shorter than `min_prefix_hit` tokens, unless it leaves one token to compute (that extend runs as a decode
        step, cheaper than recomputing the prompt)."""
        ids = req.fill_ids
        limit = len(ids) - 1
        if req.return_logprob:
            limit = min(limit, max(req.logprob_start - 1, 0))
        slots, node = self.tree.match_prefix(ids[:limit])
        if len(slots) < self.min_prefix_hit and len(slots) < len(ids) - 1:
            return slots[:0], self.tree.root
        return slots, node

    def admit(self, req: Req, prefix_slots: torch.Tensor, node: object) -> bool:
        """Give `req` a row holding its cached prefix; lock the prefix. False if no row is free."""
        idx = self.req_pool.alloc()
        if idx is None:
            return False
        req.req_pool_idx = idx
        req.prefix_len = req.kv_len = len(prefix_slots)
        if len(prefix_slots):
            self.req_pool.write(idx, 0, prefix_slots)
        req.last_node = node
        self.tree.inc_lock_ref(node)
        return True

    def alloc(self, n: int) -> torch.Tensor | None:
        """n fresh slots, evicting unlocked cache leaves if needed; None if even that is not enough."""
        if self.allocator.available < n:
            self.tree.evict(n - self.allocator.available)
        return self.allocator.alloc(n)

    def extend(self, req: Req, slots: torch.Tensor) -> None:
        """Record `slots` as the KV of fill_ids[kv_len : kv_len + len(slots)] of `req`."""
        self.req_pool.write(req.req_pool_idx, req.kv_len, slots)
        req.kv_len += len(slots)

    def extend_one_each(self, reqs: list[Req], slots: torch.Tensor) -> None:
        """Decode: one new slot per request, written into the table with a single indexed store."""
        self.req_pool.write_one_each([r.req_pool_idx for r in reqs], [r.kv_len for r in reqs], slots)
        for r in reqs:
            r.kv_len += 1

    def extend_varied(self, reqs: list[Req], counts: list[int], slots: torch.Tensor) -> None:
        """counts[i] new slots for request i (slots request by request), written with a single indexed store."""
        rows = [r.req_pool_idx for r, n in zip(reqs, counts) for _ in range(n)]
        cols = [r.kv_len + j for r, n in zip(reqs, counts) for j in range(n)]
        if rows:
            self.req_pool.write_one_each(rows, cols, slots)
        for r, n in zip(reqs, counts):
            r.kv_len += n

    def truncate(self, req: Req, kv_len: int, freed: list[torch.Tensor]) -> None:
        """Keep the KV of the first `kv_len` positions of `req` only; its slots past them (the rejected drafts of
        a speculative step) go to `freed`, for one `free_all` after the step."""
        assert req.prefix_len <= kv_len <= req.kv_len, f"cannot truncate {req.kv_len} positions to {kv_len}"
        if kv_len < req.kv_len:
            freed.append(self.req_pool.host[req.req_pool_idx, kv_len:req.kv_len].to(torch.int64))
            req.kv_len = kv_len

    def free_all(self, freed: list[torch.Tensor]) -> None:
        if freed:
            self.allocator.free(torch.cat(freed))

    def release(self, req: Req) -> None:
        """Hand the request's computed KV to the tree (or free it), unlock, and free its row."""
        if req.req_pool_idx is None:
            return
        row = self.req_pool.slots(req.req_pool_idx, req.kv_len)        # host ids: no device sync
        # NOTE: under overlap a step in flight may hold a slot past fill_ids (its input token never reached the
        # CPU: the request ended while the step before was processed); that slot has no token to cache under
        known = min(req.kv_len, len(req.fill_ids))
        if known < req.kv_len:
            self.allocator.free(row[known:])
            row = row[:known]
        own = row[req.prefix_len:]
        if self.tree.disable:
            if len(own):
                self.allocator.free(own)
        else:
            present = self.tree.insert(req.fill_ids[:known], row.clone())
            # NOTE: the tree kept its own slots for fill_ids[:present]; ours for that range are duplicates
            if present > req.prefix_len:
                self.allocator.free(row[req.prefix_len:present])
        self.tree.dec_lock_ref(req.last_node)
        self.req_pool.free(req.req_pool_idx)
        req.req_pool_idx, req.last_node, req.kv_len, req.prefix_len = None, None, 0, 0

    def flush(self) -> bool:
        return self.tree.flush()
