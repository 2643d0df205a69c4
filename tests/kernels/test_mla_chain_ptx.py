"""The one-launch MLA decode chain (`kernels/mla_chain.py`) in the PTX Triton generates for Hopper (no GPU needed):
its phases must be ordered by the counters (a release add after phase A's stores, acquire loads spinning before
phase B), phase B's prefetch must be issued before the PDL wait (it reads the step's inputs and older cache rows, no
kernel's output), and its registers must not spill. Under the interpreter the phases run as separate launches, so
only the compiled code shows this."""
from __future__ import annotations

import re
import textwrap

from hopper_ptx import compile_output          # (tests/kernels is on the path: pytest prepends it)

SCRIPT = textwrap.dedent("""
    import sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from mlaserve.kernels import mla_chain

    k = mla_chain._mla_chain_kernel
    scalars = {"eps": "fp32", "qk_scale": "fp32", "v_scale": "fp32", "kv_addr": "i64"}
    int_ptrs = {"Sync", "ReqToToken", "ReqPoolIdx", "SeqLens", "slot_ptr"}
    fp32_ptrs = {"MidO", "MidLse", "cs_ptr", "scale_ptr"}
    ptrs = {"Q", "WKC", "QLat", "WVC", "Out", "q_pe_ptr", "k_ptr", "kvc_ptr", "cache_ptr", "nw_ptr"}
    consts = dict(DN=128, L=512, R=64, DV=128, BLOCK_DN=128, BLOCK_L=512, BLOCK_R=64, BLOCK_H=16, BLOCK_N=64,
                  BLOCK_S=128, BN_A=64, BN_C=32, CHUNK_S=8, ROW_BYTES=1152, A_PROGRAMS=128, ROPE_PROGRAMS=1,
                  C_PROGRAMS=64, R_HALF=32, BLOCK_RH=32, ROPE_BLOCK_H=16, NORM=True, HAS_SCALE=False, IS_FP8=False,
                  FP8_MAX=448.0, MANT_BITS=3, MIN_EXP=-6, SOFT_ROUND=False, DOT_DTYPE=triton.language.bfloat16,
                  DOT_PREC="tf32", PHASE=0, PREFETCH=True, TIMING=TIMING_VALUE, PDL=True)
    sig = {}
    for n in k.arg_names:
        sig[n] = ("constexpr" if n in consts else scalars.get(n) or ("*i32" if n in int_ptrs else "*fp32" if n in
                  fp32_ptrs else "*bf16" if n in ptrs else "*i64" if n in ("pos_ptr", "Times") else "i32"))
    src = ASTSource(fn=k, signature=sig, constexprs=consts)
    out = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "num_stages": 2})
    sys.stdout.write(out.asm["ptx"])
""")


def test_the_phases_are_ordered_by_release_and_acquire():
    ptx = compile_output(SCRIPT.replace("TIMING_VALUE", "False"))
    assert "%globaltimer" not in ptx and "%clock64" not in ptx, "the probe's stamps must cost nothing when off"
    lines = ptx.splitlines()

    def first(pattern: str) -> int:
        return next(i for i, ln in enumerate(lines) if re.search(pattern, ln))
    wait = first(r"griddepcontrol\.wait")
    prefetch = first(r"cp\.async\.bulk\.prefetch\.L2\.global")
    arrive = first(r"red\.global\.gpu\.release\.add\.u32")
    spin = first(r"ld\.global\.gpu\.acquire\.b32")
    assert prefetch < wait < arrive < spin, (prefetch, wait, arrive, spin)
    assert "bar.sync" in lines[arrive - 4] or any("bar.sync" in ln for ln in lines[arrive - 6:arrive]), \
        "the release must follow a barrier over every thread's stores"
    assert len(re.findall(r"ld\.global\.gpu\.acquire\.b32", ptx)) >= 2        # phase B's wait and phase C's
    assert not re.search(r"\b(ld|st)\.local\b", ptx), "registers spilled"


def test_the_probes_stamps_read_both_timers():
    ptx = compile_output(SCRIPT.replace("TIMING_VALUE", "True"))
    assert ptx.count("%globaltimer") >= 12 and ptx.count("%clock64") >= 12, "twelve stamps of both timers expected"
    assert not re.search(r"\b(ld|st)\.local\b", ptx), "registers spilled"
