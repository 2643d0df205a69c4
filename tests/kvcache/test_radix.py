"""RadixCache: unit tests (split, insert contract, locks, LRU, flush, disabled) and a stateful
property test against a naive reference (a dict of cached prefixes -> slots)."""
from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from mlaserve.kvcache.allocator import TokenSlotAllocator
from mlaserve.kvcache.radix import RadixCache, TreeNode

Prefix = tuple[int, ...]


def make(size: int = 64, **kw) -> tuple[TokenSlotAllocator, RadixCache]:
    alloc = TokenSlotAllocator(size)
    return alloc, RadixCache(alloc, **kw)


def put(cache: RadixCache, tokens: list[int]) -> tuple[torch.Tensor, int]:
    """Insert `tokens` with fresh slots, freeing the duplicates as the contract says."""
    slots = cache.allocator.alloc(len(tokens))
    n_present = cache.insert(tokens, slots)
    cache.allocator.free(slots[:n_present])
    return slots, n_present


def path_of(node: TreeNode) -> Prefix:
    keys = []
    while node.parent is not None:
        keys.append(node.key)
        node = node.parent
    return tuple(t for key in reversed(keys) for t in key)


def tree_content(cache: RadixCache) -> tuple[dict[Prefix, int], dict[Prefix, int]]:
    """Every cached prefix -> (slot of its last token, lock_ref of the node holding that token)."""
    slots, locks, stack = {}, {}, [(cache.root, ())]
    while stack:
        node, path = stack.pop()
        for first, child in node.children.items():
            assert child.key[0] == first and child.parent is node
            assert len(child.key) == child.value.numel() > 0
            for j, s in enumerate(child.value.tolist()):
                slots[path + child.key[:j + 1]] = s
                locks[path + child.key[:j + 1]] = child.lock_ref
            stack.append((child, path + child.key))
    return slots, locks


# ---- unit tests ------------------------------------------------------------------------------------
def test_empty_cache_matches_nothing():
    alloc, cache = make()
    m = cache.match_prefix([1, 2, 3])
    assert m.slots.numel() == 0 and m.slots.dtype == torch.int64 and m.node is cache.root


def test_match_ending_inside_a_node_splits_it():
    alloc, cache = make()
    slots, _ = put(cache, [1, 2, 3, 4])
    m = cache.match_prefix([1, 2, 9])
    assert m.slots.tolist() == slots[:2].tolist()
    assert m.node.key == (1, 2) and list(m.node.children) == [3] and m.node.children[3].key == (3, 4)
    assert path_of(m.node) == (1, 2)
    assert cache.match_prefix([1, 2, 3, 4, 5]).slots.tolist() == slots.tolist()   # still all there
    assert "[1, 2]" in cache.pretty() and "[3, 4]" in cache.pretty()


def test_insert_returns_present_prefix_length_and_keeps_first_slots():
    size = 64
    alloc, cache = make(size)
    first, n = put(cache, [1, 2, 3])
    assert n == 0
    second, n = put(cache, [1, 2, 3, 4, 5])
    assert n == 3
    third, n = put(cache, [1, 2, 7])
    assert n == 2
    _, n = put(cache, [1, 2, 3])
    assert n == 3
    # The cache keeps the slots of the first insert for shared positions, and the new ones after.
    assert cache.match_prefix([1, 2, 3, 4, 5]).slots.tolist() == first.tolist() + second[3:].tolist()
    assert cache.match_prefix([1, 2, 7]).slots.tolist() == first[:2].tolist() + third[2:].tolist()
    assert cache.total_size() == 6 and alloc.available + cache.total_size() == size


def test_insert_copies_slots_from_caller_tensor():
    alloc, cache = make()
    slots = alloc.alloc(3)
    buf = slots.to(torch.int32)                  # e.g. a row of the req -> token table
    cache.insert([4, 5, 6], buf)
    expect = buf.tolist()
    buf.zero_()
    assert cache.match_prefix([4, 5, 6]).slots.tolist() == expect


def test_insert_needs_one_slot_per_token():
    alloc, cache = make()
    with pytest.raises(AssertionError):
        cache.insert([1, 2, 3], alloc.alloc(2))


def test_lock_protects_from_eviction():
    size = 32
    alloc, cache = make(size)
    put(cache, [1, 2, 3, 4])
    put(cache, [1, 2, 5])
    put(cache, [9, 9])
    node = cache.match_prefix([1, 2, 3, 4]).node
    cache.inc_lock_ref(node)
    assert cache.protected_size == 4 and cache.evictable_size == 3
    assert cache.evict(100) == 3                  # [5] and [9, 9]; the locked path stays
    assert cache.match_prefix([1, 2, 3, 4]).slots.numel() == 4
    assert cache.match_prefix([1, 2, 5]).slots.numel() == 2
    assert cache.match_prefix([9, 9]).slots.numel() == 0
    cache.dec_lock_ref(node)
    assert cache.protected_size == 0 and cache.evictable_size == 4
    with pytest.raises(ValueError):
        cache.dec_lock_ref(node)
    assert cache.evict(4) == 4 and cache.total_size() == 0 and alloc.available == size


def test_evict_least_recently_used_first():
    seqs = [[t] * random.randint(1, 4) for t in (1, 2, 3, 4)]
    alloc, cache = make()
    for s in seqs:
        put(cache, s)
    order = random.sample(range(4), 4)           # touch in this order: order[0] is the LRU one
    for i in order:
        cache.match_prefix(seqs[i])
    for k, i in enumerate(order):
        assert cache.evict(1) == len(seqs[i])
        for j in order[k + 1:]:
            assert cache.match_prefix(seqs[j]).slots.numel() == len(seqs[j])   # re-touch keeps order


def test_evict_reaches_parents_after_their_children():
    alloc, cache = make()
    put(cache, [1, 2, 3])
    put(cache, [1, 2, 4])
    put(cache, [7])
    cache.match_prefix([7])                      # [1, 2] subtree is older
    assert cache.evict(3) == 4                   # leaves [3], [4], then [1, 2] (whole nodes)
    assert cache.match_prefix([1]).slots.numel() == 0 and cache.total_size() == 1


def test_flush_refused_while_locked():
    size = 16
    alloc, cache = make(size)
    put(cache, [1, 2, 3])
    put(cache, [4])
    node = cache.match_prefix([1, 2]).node
    cache.inc_lock_ref(node)
    assert cache.flush() is False and cache.total_size() == 4
    cache.dec_lock_ref(node)
    assert cache.flush() is True
    assert cache.total_size() == 0 and alloc.available == size
    assert cache.match_prefix([1, 2, 3]).slots.numel() == 0


def test_disabled_cache_is_empty_and_frees_inserted_slots():
    size = 16
    alloc, cache = make(size, disable=True)
    slots = alloc.alloc(5)
    assert cache.insert([1, 2, 3, 4, 5], slots) == 0    # ownership passes, freed at once
    assert alloc.available == size and cache.total_size() == 0
    m = cache.match_prefix([1, 2, 3])
    assert m.slots.numel() == 0 and m.node is cache.root
    cache.inc_lock_ref(m.node)
    cache.dec_lock_ref(m.node)
    assert cache.evict(10) == 0 and cache.flush() is True and alloc.available == size


# ---- property test against a naive reference ------------------------------------------------------
MAX_LEN = 8


@dataclass
class Running:
    seq: Prefix
    p: int                    # matched (and locked) prefix length
    node: TreeNode
    prefix: torch.Tensor      # [p] slots owned by the cache
    new: torch.Tensor         # [len(seq) - p] slots owned by the request


class RadixMachine(RuleBasedStateMachine):
    """Requests match + lock, allocate the rest, insert + free duplicates + unlock; plus plain
    matches, fresh inserts, evictions and flushes. The reference is `ref`: cached prefix -> slot of its
    last token (prefix-closed), `time`: cached prefix -> last access, locks from `running`."""

    @initialize(corpus=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=MAX_LEN),
                                min_size=2, max_size=6),
                size=st.integers(6, 24))
    def setup(self, corpus: list[list[int]], size: int) -> None:
        self.size = size
        self.alloc = TokenSlotAllocator(size)
        self.cache = RadixCache(self.alloc)
        self.corpus = [tuple(c) for c in corpus]
        self.ref: dict[Prefix, int] = {}
        self.time: dict[Prefix, int] = {}
        self.now = 0
        self.running: list[Running] = []

    # reference helpers
    def ref_match(self, seq: Prefix) -> int:
        i = 0
        while i < len(seq) and seq[:i + 1] in self.ref:
            i += 1
        return i

    def touch(self, seq: Prefix, n: int) -> None:
        self.now += 1
        for j in range(1, n + 1):
            self.time[seq[:j]] = self.now

    def locked(self) -> dict[Prefix, int]:
        count: dict[Prefix, int] = {}
        for r in self.running:
            for j in range(1, r.p + 1):
                count[r.seq[:j]] = count.get(r.seq[:j], 0) + 1
        return count

    def checked_match(self, seq: Prefix) -> tuple[torch.Tensor, TreeNode]:
        m = self.cache.match_prefix(list(seq))
        p = self.ref_match(seq)
        assert m.slots.tolist() == [self.ref[seq[:j]] for j in range(1, p + 1)]
        assert path_of(m.node) == seq[:p]
        self.touch(seq, p)
        return m.slots, m.node

    def checked_insert(self, seq: Prefix, slots: torch.Tensor) -> int:
        expect = self.ref_match(seq)
        n = self.cache.insert(list(seq), slots)
        assert n == expect
        for j in range(n + 1, len(seq) + 1):
            self.ref[seq[:j]] = int(slots[j - 1])
        self.touch(seq, len(seq))
        return n

    def checked_evict(self, num: int) -> None:
        before, avail = dict(self.ref), self.alloc.available
        locked = self.locked()
        evictable = len(before) - len(locked)
        got = self.cache.evict(num)
        after, _ = tree_content(self.cache)
        assert after.items() <= before.items()
        gone = before.keys() - after.keys()
        assert got == len(gone) and self.alloc.available == avail + got
        assert not gone & locked.keys()
        assert got == evictable if evictable < num else num <= got < num + MAX_LEN   # whole nodes
        # LRU: nothing evicted is more recent than a surviving unlocked leaf.
        parents = {k[:-1] for k in after}
        leaves = [k for k in after if k not in parents and k not in locked]
        if gone and leaves:
            assert max(self.time[k] for k in gone) <= min(self.time[k] for k in leaves)
        self.ref = after
        self.time = {k: t for k, t in self.time.items() if k in after}

    def alloc_or_evict(self, n: int) -> torch.Tensor | None:
        if n > self.alloc.available:
            self.checked_evict(n - self.alloc.available)
        return self.alloc.alloc(n)

    # operations
    @rule(i=st.integers(0, 5))
    def match(self, i: int) -> None:
        self.checked_match(self.corpus[i % len(self.corpus)])

    @precondition(lambda self: len(self.running) < 3)
    @rule(i=st.integers(0, 5))
    def start_request(self, i: int) -> None:
        seq = self.corpus[i % len(self.corpus)]
        prefix, node = self.checked_match(seq)
        self.cache.inc_lock_ref(node)
        req = Running(seq, prefix.numel(), node, prefix, prefix[:0])
        self.running.append(req)
        new = self.alloc_or_evict(len(seq) - req.p)
        if new is None:
            self.running.pop()
            self.cache.dec_lock_ref(node)
        else:
            req.new = new

    @precondition(lambda self: self.running)
    @rule(k=st.integers(0, 2))
    def finish_request(self, k: int) -> None:
        req = self.running.pop(k % len(self.running))
        slots = torch.cat([req.prefix, req.new])
        n = self.checked_insert(req.seq, slots)
        assert n >= req.p                       # a locked match is still cached
        self.alloc.free(slots[req.p:n])
        self.cache.dec_lock_ref(req.node)

    @rule(i=st.integers(0, 5))
    def insert_fresh(self, i: int) -> None:
        seq = self.corpus[i % len(self.corpus)]
        slots = self.alloc_or_evict(len(seq))
        if slots is not None:
            n = self.checked_insert(seq, slots)
            self.alloc.free(slots[:n])

    @rule(num=st.integers(0, 12))
    def evict(self, num: int) -> None:
        self.checked_evict(num)

    @rule()
    def flush(self) -> None:
        ok = self.cache.flush()
        assert ok == (not self.locked())
        if ok:
            self.ref, self.time = {}, {}

    @invariant()
    def matches_reference(self) -> None:
        if not hasattr(self, "cache"):
            return
        slots, locks = tree_content(self.cache)
        assert slots == self.ref
        locked = self.locked()
        assert all(locks[k] == locked.get(k, 0) for k in slots)
        assert self.cache.protected_size == len(locked)
        assert self.cache.evictable_size == len(slots) - len(locked)
        assert self.cache.total_size() == len(slots)
        # No leak, no double ownership: tree + free list + running requests' own slots = 1..size.
        held = [s for r in self.running for s in r.new.tolist()]
        owned = list(slots.values()) + self.alloc.free_slots.tolist() + held
        assert sorted(owned) == list(range(1, self.size + 1))


RadixMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=50, deadline=None)
TestRadixAgainstReference = RadixMachine.TestCase
