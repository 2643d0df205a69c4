"""KV token-slot allocator and the request -> token-slot table.

Slots index the rows of the per-layer latent pool (`kvcache/pool.py`); slot 0 is the padding slot.
"""
from __future__ import annotations

import torch

# Slot layout of a pool built with `size` usable slots:
#
#   slot   | 0              | 1 .. size
#   -------+----------------+---------------------------------------------
#   use    | padding (dummy | tokens of requests / the radix cache; handed
#          | writes of CUDA | out by `TokenSlotAllocator.alloc`
#          | graph batches) |
PAD_SLOT = 0


class TokenSlotAllocator:
    """Hands out and takes back KV token slots `1..size`; slot 0 is never handed out.

    The free list is a device tensor, so `alloc` is a slice and `free` a concatenation.
    `free` validates its argument (slot 0, out of range, already free, repeated in the call) with one
    device->host sync per call; wrap many frees in `begin_free_group()` / `end_free_group()` to pay
    that once.

    Args:
        size: number of usable slots (the pool has `size + 1` rows, row 0 being padding).
        device: where slot ids live (the pool's device).
    """

    def __init__(self, size: int, device: str | torch.device = "cpu"):
        assert size >= 1, f"size must be >= 1, got {size}"
        self.size = size
        self.device = torch.device(device)
        self._group: list[torch.Tensor] | None = None
        self.clear()

    def clear(self) -> None:
        """Every slot `1..size` free again (any open free group is dropped)."""
        self._free = torch.arange(1, self.size + 1, dtype=torch.int64, device=self.device)  # [F]
        self._is_free = torch.ones(self.size + 1, dtype=torch.bool, device=self.device)    # [size + 1]
        self._is_free[PAD_SLOT] = False
        self._group = None

    @property
    def available(self) -> int:
        return self._free.numel()

    @property
    def free_slots(self) -> torch.Tensor:
        """The free list (read-only view, for debugging and tests): [available] int64."""
        return self._free

    def alloc(self, n: int) -> torch.Tensor | None:
        """Take `n` slots: [n] int64 on `device`, or None (nothing taken) if fewer than `n` are free."""
        assert n >= 0, f"cannot allocate {n} slots"
        if n > self._free.numel():
            return None
        out, self._free = self._free[:n], self._free[n:]
        self._is_free[out] = False
        return out

    def free(self, slots: torch.Tensor) -> None:
        """Return `slots` (1-D, any integer dtype). Raises ValueError on slot 0, out-of-range ids,
        slots already free or repeated; on error nothing is freed. Inside a free group the slots are
        only queued (checked and freed by `end_free_group`)."""
        assert slots.dim() == 1, f"slots must be 1-D, got shape {tuple(slots.shape)}"
        assert not slots.is_floating_point(), f"slots must be integer ids, got {slots.dtype}"
        if slots.numel() == 0:
            return
        slots = slots.to(self.device, torch.int64)
        if self._group is not None:
            self._group.append(slots)
            return
        self._mark_free(slots)
        self._free = torch.cat([self._free, slots])

    def begin_free_group(self) -> None:
        assert self._group is None, "free groups do not nest"
        self._group = []

    def end_free_group(self) -> None:
        assert self._group is not None, "end_free_group without begin_free_group"
        group, self._group = self._group, None
        if group:
            self.free(torch.cat(group))

    def _mark_free(self, slots: torch.Tensor) -> None:
        """Set `_is_free[slots]`, or undo it and raise if any id is bad (one device->host sync)."""
        clamped = slots.clamp(0, self.size)
        before = self._is_free[clamped]
        self._is_free[clamped] = True
        # NOTE: _is_free.sum() == available always; a slot already free or repeated adds fewer.
        newly_free = self._is_free.sum() - self._free.numel()
        ok = (newly_free == slots.numel()) & (slots.min() >= 1) & (slots.max() <= self.size)
        if not bool(ok):
            self._is_free[clamped] = before
            raise ValueError(self._describe_bad(slots))

    def _describe_bad(self, slots: torch.Tensor) -> str:
        ids = sorted(slots.tolist())
        bad_range = [i for i in ids if not 1 <= i <= self.size]
        if bad_range:
            return f"cannot free slot ids {bad_range[:8]}: valid slots are 1..{self.size} (0 is padding)"
        twice = sorted({a for a, b in zip(ids, ids[1:]) if a == b})
        if twice:
            return f"slots {twice[:8]} repeated in one free"
        free = [i for i in ids if bool(self._is_free[i])]
        return f"double free of slots {free[:8]}"


class ReqToTokenPool:
    """[max_reqs, max_context] int32 table: position -> slot for each live request row.

    Rows are handed out by `alloc` and taken back by `free`; a freed row keeps its stale contents
    (readers only look at positions below the request's length).
    """

    def __init__(self, max_reqs: int, max_context: int, device: str | torch.device = "cpu"):
        assert max_reqs >= 1 and max_context >= 1, f"bad table shape ({max_reqs}, {max_context})"
        self.max_reqs = max_reqs
        self.max_context = max_context
        self.device = torch.device(device)
        self.table = torch.zeros(max_reqs, max_context, dtype=torch.int32, device=self.device)
        self.clear()

    def clear(self) -> None:
        self._free_rows = list(range(self.max_reqs - 1, -1, -1))   # popped from the end: row 0 first
        self._live: set[int] = set()

    @property
    def available(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        """A free row index, or None if all `max_reqs` rows are live."""
        if not self._free_rows:
            return None
        idx = self._free_rows.pop()
        self._live.add(idx)
        return idx

    def free(self, idx: int) -> None:
        if idx not in self._live:
            raise ValueError(f"request row {idx} is not live (double free or never allocated)")
        self._live.remove(idx)
        self._free_rows.append(idx)

    def write(self, idx: int, start: int, slots: torch.Tensor) -> None:
        """table[idx, start:start + len(slots)] = slots (any integer dtype, stored as int32)."""
        assert idx in self._live, f"request row {idx} is not live"
        assert slots.dim() == 1, f"slots must be 1-D, got shape {tuple(slots.shape)}"
        end = start + slots.numel()
        assert 0 <= start and end <= self.max_context, (
            f"positions {start}..{end} do not fit max_context={self.max_context}")
        self.table[idx, start:end] = slots.to(self.device, torch.int32)
