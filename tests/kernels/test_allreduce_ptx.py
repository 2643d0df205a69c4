"""The peer all-reduce kernels' epoch counters, in the PTX Triton generates for Hopper (no GPU needed).

Each program reads its row's epoch counter and stores counter + 1. Triton lowers the scalar load to every thread and
the store to one thread: without a barrier between them, a warp that loads after that store takes epoch + 1 and the
program's warps disagree on the epoch (V3's [64, 7168] decode calls stopped both ranks on two H200s:
benchmarks/results/tp-h200x2.md, seventh run). The interpreter runs a program as one thread, so only the generated
code shows the order. Compiled in a subprocess: under this suite's TRITON_INTERPRET=1 the kernels are interpreted.
"""
from __future__ import annotations

import re
import textwrap

from hopper_ptx import compile_output          # (tests/kernels is on the path: pytest prepends it)

SCRIPT = textwrap.dedent("""
    import sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from mlaserve.kernels import allreduce

    def ptx(kernel, constexprs, warps):
        sig = {}
        for name in kernel.arg_names:
            if name in constexprs:
                sig[name] = "constexpr"
            elif name.endswith("_ptr"):
                sig[name] = "*bf16"
            elif name.endswith("_ptrs"):
                sig[name] = "*i64"
            else:
                sig[name] = "fp32" if name == "eps" else "i32"
        sig["epoch_ptr"] = "*i32"
        src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).asm["ptx"]

    pull = ptx(allreduce._peer_all_reduce_kernel,
               dict(WORLD=2, MAX_ROWS=128, BLOCK=8192, NORM=False, PDL=True), 16)
    push = ptx(allreduce._peer_all_reduce_ll_kernel,
               dict(WORLD=2, SPLIT=1, CHUNK=8192, BLOCK=8192, NORM=False), 16)
    sys.stdout.write(pull + "\\n=== push ===\\n" + push)
""")


def _epoch_update(ptx: str) -> list[str]:
    """The instructions from the kernel's first 32-bit global load (the epoch counter: what comes before it reads
    parameters only) to the first 32-bit global store after it (the advanced counter; the push kernel stores it in a
    loop over the row's counters, at another address register)."""
    lines = [ln.strip() for ln in ptx.splitlines()]
    load = next(i for i, ln in enumerate(lines) if re.match(r"ld\.global\.b32 \{ %r\d+ \}, \[ %rd\d+ \+ 0 \];", ln))
    store = next(i for i in range(load + 1, len(lines)) if re.search(r"st\.global\.b32 \[", lines[i]))
    return lines[load:store + 1]


def test_every_warp_reads_the_epoch_before_it_is_advanced():
    out = compile_output(SCRIPT)
    pull, push = out.split("\n=== push ===\n")
    for name, ptx in (("pull", pull), ("push", push)):
        update = _epoch_update(ptx)
        assert any(ln.startswith("bar.sync") for ln in update), \
            f"{name}: no barrier between the epoch's load and its store:\n" + "\n".join(update)
