"""TokenSlotAllocator and ReqToTokenPool: slot accounting, padding slot, exhaustion, double frees, host-side
bookkeeping (the device table is only written)."""
from __future__ import annotations

import random

import pytest
import torch

from mlaserve.kvcache.allocator import PAD_SLOT, ReqToTokenPool, TokenSlotAllocator


def test_alloc_hands_out_every_usable_slot_once_and_never_slot_0():
    size = random.randint(5, 40)
    alloc = TokenSlotAllocator(size)
    got = []
    while (s := alloc.alloc(random.randint(1, 3))) is not None:
        assert s.dtype == torch.int64 and s.device.type == "cpu"
        got += s.tolist()
    assert PAD_SLOT not in got
    # The loop stops at the first request larger than what is left: hand that out one by one.
    while alloc.available:
        got += alloc.alloc(1).tolist()
    assert sorted(got) == list(range(1, size + 1))
    assert alloc.alloc(1) is None


def test_exhaustion_returns_none_and_takes_nothing():
    alloc = TokenSlotAllocator(10)
    assert alloc.alloc(7) is not None
    assert alloc.alloc(4) is None
    assert alloc.available == 3
    assert alloc.alloc(3).numel() == 3
    assert alloc.alloc(0).numel() == 0


def test_free_returns_slots_and_available_tracks():
    size = 32
    alloc = TokenSlotAllocator(size)
    held = [alloc.alloc(random.randint(1, 8)) for _ in range(3)]
    assert alloc.available == size - sum(h.numel() for h in held)
    random.shuffle(held)
    for h in held:
        alloc.free(h.to(torch.int32))        # int32 ids (as read back from the req table) are fine
    assert alloc.available == size
    assert sorted(alloc.free_slots.tolist()) == list(range(1, size + 1))


def test_random_alloc_free_matches_a_set_model(monkeypatch):
    """Any interleaving of allocs and frees (more chunks than the merge threshold, small here) hands out each
    free slot once and takes back exactly what was freed; freed slots go out again before never-used ones."""
    monkeypatch.setattr("mlaserve.kvcache.allocator.MAX_FREED_CHUNKS", 5)
    seed = random.randrange(1 << 30)
    print("seed", seed)
    rng = random.Random(seed)
    size = 300
    alloc = TokenSlotAllocator(size)
    free, held, used = set(range(1, size + 1)), [], set()
    for _ in range(400):
        if held and rng.random() < 0.45:
            h = held.pop(rng.randrange(len(held)))
            keep = h.clone()
            alloc.free(h)
            h.fill_(1)                        # the allocator kept a copy: the caller may reuse its tensor
            free |= set(keep.tolist())
        else:
            n = rng.randint(0, 12)
            s = alloc.alloc(n)
            if n > len(free):
                assert s is None
                continue
            got = s.tolist()
            assert len(got) == n and set(got) <= free and len(set(got)) == n
            reused = free & used
            if len(reused) >= n:              # slots given back are handed out before never-used ones
                assert set(got) <= used
            free -= set(got)
            used |= set(got)
            held.append(s.clone())
        assert alloc.available == len(free)
        assert sorted(alloc.free_slots.tolist()) == sorted(free)


@pytest.mark.parametrize("bad", ["twice", "pad", "range", "repeat"])
def test_bad_free_raises_and_changes_nothing(bad: str):
    alloc = TokenSlotAllocator(16)
    s = alloc.alloc(6)
    if bad == "twice":
        alloc.free(s[:3])
        arg = s[2:4]                         # slot s[2] is already free
    else:
        arg = {"pad": torch.tensor([PAD_SLOT]), "range": torch.tensor([17]),
               "repeat": torch.cat([s[:2], s[1:2]])}[bad]
    before = alloc.free_slots.clone()
    with pytest.raises(ValueError):
        alloc.free(arg)
    assert torch.equal(alloc.free_slots, before)
    alloc.free(s[3:] if bad == "twice" else s)    # the failed call left the held slots freeable
    assert alloc.available == 16


def test_free_takes_host_ids_only():
    alloc = TokenSlotAllocator(8)
    s = alloc.alloc(3)
    with pytest.raises(AssertionError, match="host"):
        alloc.free(s.to("meta"))             # device ids: reading them would wait for the device
    alloc.free(s)
    assert alloc.available == 8


def test_clear_restores_everything():
    alloc = TokenSlotAllocator(8)
    alloc.alloc(8)
    alloc.clear()
    assert alloc.available == 8
    assert sorted(alloc.alloc(8).tolist()) == list(range(1, 9))


def test_req_to_token_pool_rows_and_writes():
    max_reqs, max_context = 4, 16
    pool = ReqToTokenPool(max_reqs, max_context)
    assert pool.table.shape == (max_reqs, max_context) and pool.table.dtype == torch.int32
    rows = [pool.alloc() for _ in range(max_reqs)]
    assert sorted(rows) == list(range(max_reqs)) and pool.alloc() is None and pool.available == 0
    slots = torch.randint(1, 1000, (10,), dtype=torch.int64)
    pool.write(rows[1], 3, slots[:6])
    pool.write(rows[1], 9, slots[6:])        # an extend appends after the prefix
    assert pool.table[rows[1], 3:13].tolist() == slots.tolist()
    with pytest.raises(AssertionError):
        pool.write(rows[1], 10, slots)       # 10 + 10 > max_context
    pool.free(rows[2])
    with pytest.raises(ValueError):
        pool.free(rows[2])
    with pytest.raises(AssertionError):
        pool.write(rows[2], 0, slots)        # not live any more
    assert pool.available == 1 and pool.alloc() == rows[2]


def test_req_to_token_pool_device_table_follows_host_copy():
    pool = ReqToTokenPool(3, 8, device="meta")   # a device table whose values cannot be read back
    assert pool.host is not pool.table and pool.host.device.type == "cpu"
    row = pool.alloc()
    pool.write(row, 0, torch.tensor([4, 5, 6]))
    pool.write_one_each([row], [3], torch.tensor([9]))
    assert pool.slots(row, 4).tolist() == [4, 5, 6, 9] and pool.slots(row, 4).dtype == torch.int64
    with pytest.raises(AssertionError, match="host"):
        pool.write(row, 4, torch.tensor([1], device="meta"))
    cpu = ReqToTokenPool(2, 8)                   # on the CPU the table is its own host copy
    assert cpu.host is cpu.table
    r = cpu.alloc()
    cpu.write_one_each([r], [2], torch.tensor([7]))
    assert cpu.table[r, 2].item() == 7
