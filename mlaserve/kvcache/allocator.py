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
MAX_FREED_CHUNKS = 4096     # `TokenSlotAllocator.free` merges its chunks past this many


class TokenSlotAllocator:
    """Hands out and takes back KV token slots `1..size`; slot 0 is never handed out.

    Host-side bookkeeping (CPU tensors): slot ids reach the device only as copies written into the
    request -> token table (`ReqToTokenPool`) and the batch's output slots, so `alloc` and `free` never wait
    for the device, e.g. while the overlap scheduler frees a finished request's slots with the next step in
    flight. `free` validates its argument (slot 0, out of range, already free, repeated) on that host data.

    Args:
        size: number of usable slots (the pool has `size + 1` rows, row 0 being padding).
    """

    def __init__(self, size: int):
        assert size >= 1, f"size must be >= 1, got {size}"
        self.size = size
        self.clear()

    def clear(self) -> None:
        """Every slot `1..size` free again."""
        self._fresh = torch.arange(1, self.size + 1, dtype=torch.int64)     # [F] never handed out since clear
        self._freed: list[torch.Tensor] = []                                # chunks given back, reused first
        self._freed_n = 0
        self._is_free = torch.ones(self.size + 1, dtype=torch.bool)          # [size + 1]
        self._is_free[PAD_SLOT] = False

    @property
    def available(self) -> int:
        return self._fresh.numel() + self._freed_n

    @property
    def free_slots(self) -> torch.Tensor:
        """The free slots in the order `alloc` hands them out (a copy, for debugging and tests): [available]."""
        return torch.cat(self._freed[::-1] + [self._fresh])

    def alloc(self, n: int) -> torch.Tensor | None:
        """Take `n` slots: [n] int64 on the CPU, or None (nothing taken) if fewer than `n` are free. Slots given
        back most recently go out first; then the never-used ones."""
        assert n >= 0, f"cannot allocate {n} slots"
        if n > self.available:
            return None
        parts, need = [], n
        while need and self._freed:
            chunk = self._freed[-1]
            if chunk.numel() <= need:
                parts.append(self._freed.pop())
            else:
                parts.append(chunk[:need])
                self._freed[-1] = chunk[need:]
            need -= parts[-1].numel()
        self._freed_n -= n - need
        if need or not parts:
            parts.append(self._fresh[:need])
            self._fresh = self._fresh[need:]
        out = parts[0] if len(parts) == 1 else torch.cat(parts)
        self._is_free[out] = False
        return out

    def free(self, slots: torch.Tensor) -> None:
        """Return `slots` (1-D, any integer dtype, on the CPU). Raises ValueError on slot 0, out-of-range
        ids, slots already free or repeated; on error nothing is freed. Costs O(len(slots)), not O(pool): the
        slots are kept as a chunk (a copy: the caller may reuse its tensor) until `alloc` hands them out."""
        assert slots.dim() == 1, f"slots must be 1-D, got shape {tuple(slots.shape)}"
        assert not slots.is_floating_point(), f"slots must be integer ids, got {slots.dtype}"
        assert slots.device.type == "cpu", f"free takes host slot ids (reading {slots.device} ones would sync)"
        if slots.numel() == 0:
            return
        slots = slots.to(torch.int64, copy=True)
        error = self._check(slots)
        if error:
            raise ValueError(error)
        self._is_free[slots] = True
        self._freed.append(slots)
        self._freed_n += slots.numel()
        if len(self._freed) > MAX_FREED_CHUNKS:      # many small frees: one chunk, so alloc stays a short loop
            self._freed = [torch.cat(self._freed)]

    def _check(self, slots: torch.Tensor) -> str | None:
        lo, hi = int(slots.min()), int(slots.max())
        if lo < 1 or hi > self.size:
            bad = sorted({i for i in slots.tolist() if not 1 <= i <= self.size})
            return f"cannot free slot ids {bad[:8]}: valid slots are 1..{self.size} (0 is padding)"
        if bool(self._is_free[slots].any()):
            free = sorted({i for i in slots.tolist() if self._is_free[i]})
            return f"double free of slots {free[:8]}"
        if torch.unique(slots).numel() != slots.numel():
            ids = sorted(slots.tolist())
            return f"slots {sorted({a for a, b in zip(ids, ids[1:]) if a == b})[:8]} repeated in one free"
        return None


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`t` on `device`; a host tensor goes to a GPU through pinned memory without waiting for the device."""
    device = torch.device(device)
    if t.device == device or t.device.type != "cpu" or device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


class ReqToTokenPool:
    """[max_reqs, max_context] int32 table: position -> slot for each live request row.

    `table` lives on the device (the attention kernels read it); `host` is its CPU copy, the one the
    scheduler reads (which slots a request holds) so that it never waits for the device. Writes take host
    slot ids and go to both. Rows are handed out by `alloc` and taken back by `free`; a freed row keeps
    its stale contents (readers only look at positions below the request's length).
    """

    def __init__(self, max_reqs: int, max_context: int, device: str | torch.device = "cpu"):
        assert max_reqs >= 1 and max_context >= 1, f"bad table shape ({max_reqs}, {max_context})"
        self.max_reqs = max_reqs
        self.max_context = max_context
        self.device = torch.device(device)
        self.table = torch.zeros(max_reqs, max_context, dtype=torch.int32, device=self.device)
        self.host = self.table if self.device.type == "cpu" else torch.zeros(max_reqs, max_context, dtype=torch.int32)
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
        """table[idx, start:start + len(slots)] = slots (host ids, any integer dtype, stored as int32)."""
        assert idx in self._live, f"request row {idx} is not live"
        assert slots.dim() == 1 and slots.device.type == "cpu", \
            f"slots must be 1-D host ids, got shape {tuple(slots.shape)} on {slots.device}"
        end = start + slots.numel()
        assert 0 <= start and end <= self.max_context, (
            f"positions {start}..{end} do not fit max_context={self.max_context}")
        self.host[idx, start:end] = slots.to(torch.int32)
        if self.host is not self.table:
            self.table[idx, start:end] = to_device(self.host[idx, start:end], self.device)

    def write_one_each(self, rows: list[int], cols: list[int], slots: torch.Tensor) -> None:
        """table[rows[b], cols[b]] = slots[b] for every b (one new slot per request) as one indexed store."""
        assert all(r in self._live for r in rows), "every request row must be live"
        assert len(rows) == len(cols) == slots.numel() and slots.device.type == "cpu", "one host slot per row"
        index = torch.tensor([rows, cols], dtype=torch.int64)                 # [2, B]
        self.host[index[0], index[1]] = slots.to(torch.int32)
        if self.host is not self.table:
            index, values = to_device(index, self.device), to_device(slots.to(torch.int32), self.device)
            self.table[index[0], index[1]] = values

    def slots(self, idx: int, end: int) -> torch.Tensor:
        """The slots of positions 0 .. end - 1 of row `idx`, from the host copy: [end] int64."""
        return self.host[idx, :end].to(torch.int64)
