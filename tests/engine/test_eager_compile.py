"""torch.compile without CUDA graphs (--enable-torch-compile --disable-cuda-graph, a row of the seeds' ablation) in
the scheduler on the CPU (fp32): the engine's runners run each decode size's padded forward through the compiled
module up to --torch-compile-max-bs, eagerly, every size compiled at start-up; larger batches take the plain eager
path; the tokens equal those of the plain engine, with and without speculative decoding.

torch.compile is replaced by a recording stand-in here: on the CPU the reference attention reads the lengths on
the host, which a real compile would guard on and recompile at every step (why the config refuses it there). The
real compile runs in the GPU tests (tests/models/test_gpu_fastpath.py, tests/engine/test_spec.py).
"""
from __future__ import annotations

from dataclasses import replace

import torch

from engine.test_spec import DEMO, HEADERS, make, msg, same, spec
from mlaserve.tokenizer import load_tokenizer
from seq_runner import drive_scheduler as run


def compile_eagerly(monkeypatch, sched, max_bs: int) -> list[int]:
    """The sched's runner set up as for --enable-torch-compile --disable-cuda-graph --torch-compile-max-bs max_bs
    (init_cuda_graphs, which the CPU config does not reach); returns the batch size of every compiled call."""
    calls: list[int] = []

    def fake_compile(fn, dynamic=None):
        assert dynamic is False                          # one compile per padded size
        def compiled(ids, *args, **kwargs):
            calls.append(ids.shape[0])
            return fn(ids, *args, **kwargs)
        return compiled

    monkeypatch.setattr(torch, "compile", fake_compile)
    r = sched.runner
    r.server = replace(r.server, sched=replace(r.server.sched, torch_compile_max_bs=max_bs))
    r.init_cuda_graphs(sched.kv.req_to_token, sched.kv.req_pool.alloc())
    return calls


def test_compiled_eager_decode_equals_plain(monkeypatch):
    tok = load_tokenizer(DEMO)
    msgs = [msg(f"r{i}", tok.encode(h), max_new=12) for i, h in enumerate(HEADERS[:4])]
    arrivals = {"r1": 3, "r2": 6, "r3": 20}                 # batches of 1, 2, 3 (past the compiled sizes), then fewer
    base = run(make(DEMO), msgs, arrivals)
    sched = make(DEMO)
    calls = compile_eagerly(monkeypatch, sched, 2)
    assert sched.runner.graphs.batch_sizes == [1, 2] and not sched.runner.graphs.captured
    assert calls == [2, 1]                                 # start-up: each size once, largest first
    got = run(sched, msgs, arrivals)
    same(base, got)
    assert calls[2:] and set(calls[2:]) == {1, 2}          # decode steps of 1 and 2 requests ran compiled


def test_compiled_eager_speculative_steps_equal_plain(monkeypatch):
    tok = load_tokenizer(DEMO)
    msgs = [msg(f"s{i}", tok.encode(h), max_new=16) for i, h in enumerate(HEADERS[:3])]
    arrivals = {"s1": 2, "s2": 4}
    base = run(make(DEMO), msgs, arrivals)
    sched = spec(DEMO)
    calls = compile_eagerly(monkeypatch, sched, 2)
    graphs = sched.runner.spec.graphs
    assert graphs.batch_sizes == [1, 2] and not graphs.captured
    warm = len(calls)
    # each size's forwards: drafts (1 row a request), the verify (4: steps + 1) and the draft layer's repair (3)
    assert set(calls) == {bs * q for bs in (1, 2) for q in (1, 3, 4)}
    got = run(sched, msgs, arrivals)
    same(base, got)
    assert len(calls) > warm
    assert sched.runner.spec.target_fn is sched.runner.model          # eager again outside the compiled steps
