"""KVCacheManager keeps its bookkeeping on the host: a request's whole life (admit with a cached prefix, extend,
decode, finish, eviction, flush) runs against a device table that cannot be read back (the meta device), so
nothing on the scheduler's free path waits for the device."""
from __future__ import annotations

import torch

from mlaserve.core import Req, SamplingParams
from mlaserve.scheduler.cache import KVCacheManager


def run_request(kv: KVCacheManager, rid: str, ids: list[int], decode_steps: int) -> Req:
    req = Req(rid, ids, SamplingParams(), seed=0)
    prefix, node = kv.match(req)
    assert kv.admit(req, prefix, node)
    kv.extend(req, kv.alloc(len(ids) - req.kv_len))
    for step in range(decode_steps):
        req.output_ids.append(100 + step)
        kv.extend_one_each([req], kv.alloc(1))
    return req


def test_request_life_runs_on_host_data_only():
    kv = KVCacheManager(24, 4, 32, disable_radix=False, device="meta", min_prefix_hit=1)
    assert kv.req_to_token.device.type == "meta"
    a = run_request(kv, "a", [1, 2, 3, 4, 5, 6], decode_steps=2)
    kv.release(a)                                  # frees nothing: its KV goes to the tree
    assert kv.used() == 8 and kv.tree.total_size() == 8
    b = run_request(kv, "b", [1, 2, 3, 4, 9], decode_steps=1)
    assert b.prefix_len == 4                       # reused a's KV for the shared prefix
    kv.release(b)
    assert kv.available() == 24 and kv.tree.evictable_size == kv.used()
    c = run_request(kv, "c", list(range(30, 50)), decode_steps=3)   # needs eviction of cached leaves
    kv.release(c)
    assert kv.flush() and kv.used() == 0 and kv.allocator.available == 24
    assert torch.equal(kv.allocator.free_slots.sort().values, torch.arange(1, 25))


def test_disabled_radix_frees_on_release():
    kv = KVCacheManager(8, 2, 16, disable_radix=True, device="meta")
    req = run_request(kv, "a", [1, 2, 3], decode_steps=2)
    assert kv.used() == 5
    kv.release(req)
    assert kv.used() == 0 and req.req_pool_idx is None
