"""Radix prefix cache: a tree from token-id prefixes to the KV slots holding them (RadixAttention).

Requests that share a prompt prefix reuse its KV; unlocked leaves are evicted least recently used first.
"""
from __future__ import annotations

import heapq
import itertools
from typing import NamedTuple

import torch

from mlaserve.kvcache.allocator import TokenSlotAllocator

# A tree over token ids. Each node holds a run of tokens (`key`) and their slots (`value`, same length);
# children are keyed by the first token of their run, so siblings never share a first token.
#
#   root ─(1,2)─┬─(3,4)        cached: [1,2,3,4], [1,2,7], [5]
#               └─(7,)
#        ─(5,)
#
# NOTE: `lock_ref` counts the running requests whose matched path goes through a node; a node with
# lock_ref > 0 is "protected" and never evicted. Locks cover root..node, so every ancestor of a locked
# node is locked too, and an unlocked node has only unlocked descendants.


class TreeNode:
    __slots__ = ("key", "value", "parent", "children", "lock_ref", "last_access", "uid")
    _uids = itertools.count()

    def __init__(self, key: tuple[int, ...], value: torch.Tensor, parent: TreeNode | None):
        self.key = key                               # token ids of this run
        self.value = value                           # [len(key)] int64 slots (host ids)
        self.parent = parent
        self.children: dict[int, TreeNode] = {}
        self.lock_ref = 0
        self.last_access = 0
        self.uid = next(TreeNode._uids)              # tie-break for the eviction heap

    def __repr__(self) -> str:
        return f"TreeNode(len={len(self.key)}, lock_ref={self.lock_ref}, last_access={self.last_access})"


class MatchResult(NamedTuple):
    slots: torch.Tensor   # [P] int64: slots of the longest cached prefix (P may be 0)
    node: TreeNode        # deepest node of that prefix (the root if P == 0): lock it while in use


def _common_len(key: tuple[int, ...], tokens: tuple[int, ...], start: int) -> int:
    """Length of the common prefix of `key` and `tokens[start:]`."""
    n = min(len(key), len(tokens) - start)
    if key[:n] == tokens[start:start + n]:
        return n
    i = 0
    while key[i] == tokens[start + i]:
        i += 1
    return i


class RadixCache:
    """Prefix tree over token ids whose nodes own KV slots taken from `allocator`.

    Ownership contract (slots are freed exactly once):
      * `match_prefix` returns slots the cache still owns; the caller locks `node` while it reads them.
      * `insert(tokens, slots)` returns `n_present`, how many leading tokens the cache ALREADY held.
        The cache takes ownership of `slots[n_present:]` and keeps its own slots for `[0:n_present]`.
        A caller whose first `p` slots came from its own `match_prefix` (still locked, so still cached,
        hence `n_present >= p`) must free `slots[p:n_present]`: those are its duplicates of KV another
        request cached meanwhile. With fresh slots for everything, `p = 0`. A request that keeps running
        (chunked prefill) then reads the cache's slots for `[p:n_present]`: re-`match_prefix`, write
        them into its req -> token row, lock the new node and unlock the old one.
      * `evict` / `flush` give slots back to the allocator.

    With `disable=True` the cache stays empty: `match_prefix` returns an empty match at the root,
    lock calls are no-ops, and `insert` takes ownership as above with `n_present = 0` and frees all the
    slots at once. So one caller code path works both ways; a scheduler that frees a finished request's
    slots itself must simply not call `insert` when `disable` is set (and never insert slots that a
    running request still reads while disabled).

    Args:
        allocator: where evicted slots go back.
        disable: turn prefix caching off (see above).
    """

    def __init__(self, allocator: TokenSlotAllocator, *, disable: bool = False):
        self.allocator = allocator
        self.disable = disable
        self._clock = itertools.count(1)
        self.reset()

    def reset(self) -> None:
        """Forget the tree without freeing anything (`flush` is the freeing form)."""
        self.root = TreeNode((), self._empty(), None)
        self.root.lock_ref = 1                       # never evicted, never counted
        self._evictable = 0
        self._protected = 0

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64)

    # ---- sizes -------------------------------------------------------------------------------------
    @property
    def evictable_size(self) -> int:
        """Tokens cached in unlocked nodes."""
        return self._evictable

    @property
    def protected_size(self) -> int:
        """Tokens cached in locked nodes (in use by running requests)."""
        return self._protected

    def total_size(self) -> int:
        return self._evictable + self._protected

    # ---- lookup and insertion ----------------------------------------------------------------------
    def match_prefix(self, token_ids: list[int]) -> MatchResult:
        """Longest cached prefix of `token_ids`: its slots and deepest node.

        A match ending inside a node splits it, so the returned node covers exactly the match.
        Touches (LRU) every node on the matched path.
        """
        if self.disable:
            return MatchResult(self._empty(), self.root)
        tokens = tuple(token_ids)
        now = next(self._clock)
        node, pos, values = self.root, 0, []
        while pos < len(tokens) and (child := node.children.get(tokens[pos])) is not None:
            m = _common_len(child.key, tokens, pos)
            if m < len(child.key):
                child = self._split(child, m)   # the match ends here: child's tail differs
            child.last_access = now
            values.append(child.value)
            node, pos = child, pos + m
        slots = torch.cat(values) if values else self._empty()              # [P]
        return MatchResult(slots, node)

    def insert(self, token_ids: list[int], slots: torch.Tensor) -> int:
        """Cache `slots` ([len(token_ids)] integer ids) for `token_ids`; returns `n_present`.

        See the class docstring for who frees what: the cache owns `slots[n_present:]` afterwards and
        keeps a copy of the ids (the caller's tensor may be reused).
        """
        assert slots.dim() == 1 and slots.numel() == len(token_ids), (
            f"need one slot per token: {len(token_ids)} tokens, slots of shape {tuple(slots.shape)}")
        if self.disable:
            self.allocator.free(slots)
            return 0
        tokens = tuple(token_ids)
        now = next(self._clock)
        node, pos = self.root, 0
        while pos < len(tokens) and (child := node.children.get(tokens[pos])) is not None:
            m = _common_len(child.key, tokens, pos)
            if m < len(child.key):
                child = self._split(child, m)   # the new leaf (if any) hangs off the upper half
            child.last_access = now
            node, pos = child, pos + m
        if pos < len(tokens):
            value = slots[pos:].to(torch.int64).clone()                          # [N - n_present]
            leaf = TreeNode(tokens[pos:], value, node)
            leaf.last_access = now
            node.children[tokens[pos]] = leaf
            self._evictable += len(leaf.key)
        return pos

    def _split(self, child: TreeNode, m: int) -> TreeNode:
        """Cut `child` after `m` tokens (0 < m < len); returns the new upper node, parent of `child`."""
        mid = TreeNode(child.key[:m], child.value[:m], child.parent)
        mid.lock_ref = child.lock_ref            # every path through child passes mid
        mid.last_access = child.last_access
        mid.children[child.key[m]] = child
        child.parent.children[child.key[0]] = mid
        child.key, child.value, child.parent = child.key[m:], child.value[m:], mid
        return mid

    # ---- locking -----------------------------------------------------------------------------------
    def inc_lock_ref(self, node: TreeNode) -> None:
        """Protect the path root..node from eviction (one count per running request)."""
        while node.parent is not None:               # stop at the root
            if node.lock_ref == 0:
                self._evictable -= len(node.key)
                self._protected += len(node.key)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one `inc_lock_ref(node)`."""
        if node.parent is not None and node.lock_ref <= 0:   # ancestors hold >= node's count
            raise ValueError(f"dec_lock_ref on an unlocked node {node!r}")
        while node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.key)
                self._protected -= len(node.key)
            node = node.parent

    # ---- eviction ----------------------------------------------------------------------------------
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` cached tokens if that many are evictable, least recently used
        unlocked leaves first (whole nodes, so it may free a little more). Returns tokens evicted."""
        if self.disable or num_tokens <= 0:
            return 0
        heap = [(n.last_access, n.uid, n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        evicted, freed = 0, []
        while evicted < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[leaf.key[0]]
            freed.append(leaf.value)
            evicted += len(leaf.key)
            if not parent.children and parent.lock_ref == 0:    # the root is always locked
                heapq.heappush(heap, (parent.last_access, parent.uid, parent))
        self._evictable -= evicted
        if freed:
            self.allocator.free(torch.cat(freed))
        return evicted

    def _leaves(self) -> list[TreeNode]:
        leaves, stack = [], [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root:
                leaves.append(node)
        return leaves

    def flush(self) -> bool:
        """Drop the whole tree and free its slots; refused (False, nothing changed) while any node is
        locked."""
        if self._protected > 0:
            return False
        values, stack = [], [self.root]
        while stack:
            node = stack.pop()
            values.append(node.value)
            stack.extend(node.children.values())
        self.reset()
        slots = torch.cat(values)
        if slots.numel():
            self.allocator.free(slots)
        return True

    # ---- debugging ---------------------------------------------------------------------------------
    def pretty(self, max_tokens: int = 8) -> str:
        """Indented dump: one line per node with its tokens (first `max_tokens`), slots, lock, time."""
        lines = [f"RadixCache(evictable={self._evictable}, protected={self._protected}"
                 f"{', disabled' if self.disable else ''})"]
        stack = [(c, 1) for c in reversed(list(self.root.children.values()))]
        while stack:
            node, depth = stack.pop()
            more = "..." if len(node.key) > max_tokens else ""
            lines.append(f"{'  ' * depth}{list(node.key[:max_tokens])}{more} "
                         f"slots={node.value[:max_tokens].tolist()}{more} "
                         f"lock={node.lock_ref} t={node.last_access}")
            stack.extend((c, depth + 1) for c in reversed(list(node.children.values())))
        return "\n".join(lines)
