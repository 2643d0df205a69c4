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

from mlaserve.engine.graph import allow_recompiles
from mlaserve.tokenizer import load_tokenizer
from seq_runner import drive_scheduler as run
from test_spec import DEMO, HEADERS, make, msg, same, spec


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


class _BreakLayer(torch.nn.Module):
    """A layer whose forward breaks the graph (as a Triton launcher does) before it reads its int layer_id."""

    def __init__(self, layer_id: int):
        super().__init__()
        self.layer_id, self.w = layer_id, torch.nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * self.w
        torch._dynamo.graph_break()
        return x + self.layer_id


def _compiled_calls(layers: int, sizes: tuple[int, ...], raise_limits: bool) -> int:
    """Graphs dynamo compiled that one forward of each size runs (real torch.compile, a counting backend), after a
    first forward of each size compiled them; eager fallbacks are not counted."""
    torch._dynamo.reset()
    calls = []

    def backend(gm, example_inputs):
        def run(*args):
            calls.append(1)
            return gm.forward(*args)
        return run

    model = torch.nn.Sequential(*(_BreakLayer(i) for i in range(layers)))
    with torch._dynamo.config.patch(recompile_limit=8, accumulated_recompile_limit=256):     # torch's defaults
        if raise_limits:
            allow_recompiles(layers, len(sizes))
        compiled = torch.compile(model, backend=backend, dynamic=False)
        for bs in sizes:
            x = torch.randn(bs, 4)
            assert torch.equal(compiled(x), model(x))
        calls.clear()
        for bs in sizes:
            compiled(torch.randn(bs, 4))
    torch._dynamo.reset()
    return len(calls)


def test_recompile_limits_cover_every_layer_and_size():
    """Each layer's code past the graph break is compiled once per layer (layer_id is guarded as a constant) and
    batch size: 12 layers x 2 sizes pass dynamo's default limit, and it runs the rest eagerly; with the limits the
    graph runners set (allow_recompiles), every layer at every size runs compiled."""
    layers, sizes = 12, (1, 2)
    full = _compiled_calls(layers, sizes, raise_limits=True)
    assert full >= layers * len(sizes)                          # each layer's resumed code, at each size
    assert _compiled_calls(layers, sizes, raise_limits=False) < full
