"""GPU: the overlap scheduler never waits for the device outside `resolve`'s wait for the step it processes.

Decode steps run under `torch.cuda.set_sync_debug_mode("error")`, which raises on any synchronising CUDA call
(blocking copies, `.item()`, `.tolist()` of device tensors, stream / device synchronisation). Requests of
different lengths finish at different steps, so their slots are freed in `drain()` while the next step is
already queued. `resolve` waits on its step's CUDA event, which the debug mode does not count: that wait is
the design (step N's tokens are needed to plan step N + 2).
"""
from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

import mlaserve
from mlaserve.config import ServerConfig
from mlaserve.core import ForwardMode, SamplingParams
from mlaserve.ipc.messages import GenerateReqMsg
from mlaserve.scheduler.grammar import xgrammar_installed
from mlaserve.scheduler.scheduler import Scheduler
from mlaserve.tools.make_checkpoint import make_config, write_checkpoint

pytestmark = pytest.mark.gpu

CONFIGS = Path(mlaserve.__file__).parent / "tools" / "configs"
LENGTHS = (2, 3, 5, 8, 13, 21)          # max_new_tokens: a request finishes at most steps


@contextmanager
def no_sync() -> Iterator[None]:
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def start(ckpt: str, params: list[SamplingParams], **kw) -> Scheduler:
    if not kw.get("disable_cuda_graph"):
        kw.setdefault("cuda_graph_max_bs", 8)      # NOTE: graph flags are rejected with --disable-cuda-graph
    server = ServerConfig.from_flat(model_path=ckpt, device="cuda", dtype="bfloat16", max_total_tokens=4096,
                                    log_level="warning", **kw)
    sched = Scheduler(server, ckpt)
    assert sched.overlap
    for i, p in enumerate(params):
        sched.add_request(GenerateReqMsg(f"r{i}", list(range(3 + i, 20 + 3 * i)), p, seed=i))
    return sched


def run_to_first_decode(sched: Scheduler, max_steps: int = 200) -> list:
    """Steps until every prompt is prefilled and a decode step is in flight (prefill may sync: not checked); fails
    after `max_steps` (e.g. every request refused: no decode ever comes)."""
    outputs = []
    for _ in range(max_steps):
        if not (sched.waiting or sched.chunked or sched.pending is None
                or sched.pending.batch.mode is not ForwardMode.DECODE):
            return outputs
        outputs += sched.step()
    raise AssertionError(f"no decode step in flight after {max_steps} steps; finished: "
                         f"{[(o.rid, o.finished) for o in outputs if o.finished is not None][:4]}")


def finished(outputs: list) -> set[str]:
    return {o.rid for o in outputs if o.finished is not None}


def test_greedy_decode_steps_never_sync(ckpt) -> None:
    params = [SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True) for n in LENGTHS]
    sched = start(ckpt, params)
    assert sched.runner.graphs is not None, "decode should run as CUDA graphs here"
    outputs = run_to_first_decode(sched)
    steps = 0
    with no_sync():                               # plan (alloc), launch (graph replay, argmax), drain (free)
        while sched.has_work:
            outputs += sched.step()
            steps += 1
    assert finished(outputs) == {f"r{i}" for i in range(len(LENGTHS))} and steps >= max(LENGTHS) - 1
    assert sched.kv.allocator.available + sched.kv.tree.total_size() == sched.kv.num_slots


def test_drain_never_syncs_with_sampling_penalties_and_eager_decode(ckpt, monkeypatch) -> None:
    params = [SamplingParams(max_new_tokens=n, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True,
                             frequency_penalty=0.5 if n % 2 else 0.0) for n in LENGTHS]
    sched = start(ckpt, params, disable_cuda_graph=True)
    drains = []
    drain = sched.drain

    def checked_drain() -> None:                 # process step N and free finished requests' slots
        with no_sync():
            drain()
        drains.append(1)

    outputs = run_to_first_decode(sched)
    monkeypatch.setattr(sched, "drain", checked_drain)
    while sched.has_work:
        outputs += sched.step()
    assert finished(outputs) == {f"r{i}" for i in range(len(LENGTHS))} and len(drains) >= max(LENGTHS) - 1
    assert sched.kv.allocator.available + sched.kv.tree.total_size() == sched.kv.num_slots


def test_constrained_decode_fills_bitmasks_without_syncing(tmp_path_factory, monkeypatch) -> None:
    assert xgrammar_installed(), "this test needs xgrammar (a test dependency: pip install xgrammar)"
    d = json.loads((CONFIGS / "deepseek-v3.json").read_text()) | {"first_k_dense_replace": 1}
    cfg = make_config(d, num_layers=2, shrink=True, fp8=False)
    path = str(write_checkpoint(cfg, tmp_path_factory.mktemp("sync-grammar") / "m", progress=False))
    params = [SamplingParams(max_new_tokens=n, temperature=1.0, seed=3, regex="[a-z]{%d}" % (n + 40)) for n in LENGTHS]
    sched = start(path, params)
    checked = []
    for name in ("drain", "bitmask"):
        owner = sched if name == "drain" else sched.grammar
        inner = getattr(owner, name)

        def no_sync_call(*args, _f=inner, **kw):     # process step N, then the bitmask of step N + 1
            with no_sync():
                out = _f(*args, **kw)
            checked.append(1)
            return out

        monkeypatch.setattr(owner, name, no_sync_call)
    outputs = run_to_first_decode(sched)
    while sched.has_work:
        outputs += sched.step()
    assert finished(outputs) == {f"r{i}" for i in range(len(LENGTHS))} and len(checked) >= 2 * (max(LENGTHS) - 1)
    assert not sched.grammar.states


def test_mixed_batches_are_processed_without_syncing(ckpt, monkeypatch) -> None:
    """--enable-mixed-chunk: prompt chunks run with the decodes in one batch; processing every step (mixed, decode,
    prefill) never waits for the device, and the decodes of a mixed batch keep their inputs on the device."""
    params = [SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True) for n in LENGTHS]
    sched = start(ckpt, params, enable_mixed_chunk=True, chunked_prefill_size=16)
    drains = []
    drain = sched.drain

    def checked_drain() -> None:
        with no_sync():
            drain()
        drains.append(1)

    monkeypatch.setattr(sched, "drain", checked_drain)
    outputs = []
    while sched.has_work:
        outputs += sched.step()
    assert finished(outputs) == {f"r{i}" for i in range(len(LENGTHS))} and sched.stats["mixed_steps"] > 0
    assert sched.kv.allocator.available + sched.kv.tree.total_size() == sched.kv.num_slots
