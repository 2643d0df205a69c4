"""The one-token fused MoE's shared-expert L2 prefetch and the router's early release, in the PTX Triton generates
for Hopper (no GPU needed; the interpreter has neither inline PTX nor griddepcontrol).

With SHARED_PREFETCH the GEMM asks for its weight rows in L2 (`prefetch.global.L2::evict_last`) before its PDL
wait, and without it asks for nothing; with EARLY_RELEASE the router lets the next kernel launch before its own
wait. Compiled in a subprocess (to a cubin: ptxas accepts the inline PTX): under this suite's TRITON_INTERPRET=1 the
kernels are interpreted.
"""
from __future__ import annotations

import textwrap

from hopper_ptx import compile_output          # (tests/kernels is on the path: pytest prepends it)

SCRIPT = textwrap.dedent("""
    import sys
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from mlaserve.kernels import fused_moe, moe_topk

    POINTERS = dict(topk_weights_ptr="*fp32", sorted_ids_ptr="*i32", expert_ids_ptr="*i32", sync_ptr="*i32",
                    num_post_pad_ptr="*i32", ar_ptrs="*i64", ar_epochs="*i32", logits_ptr="*fp32",
                    bias_ptr="*fp32", weights_ptr="*fp32", ids_ptr="*i32", mask_ptr="*i1")

    def compiled(kernel, constexprs, warps):
        sig = {}
        for name in kernel.arg_names:
            if name in constexprs:
                sig[name] = "constexpr"
            elif name in POINTERS:
                sig[name] = POINTERS[name]
            elif name.endswith("_ptr"):
                sig[name] = "*bf16"
            else:
                sig[name] = "fp32" if name in ("eps", "routed_scaling_factor") else "i32"
        src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
        assert k.asm["cubin"]
        return k.asm["ptx"]

    def moe(prefetch, gated):
        return compiled(fused_moe._fused_moe_kernel, dict(
            A_DIV=8 if gated else 1, GATED=gated, MUL_WEIGHT=not gated, FP8=False, QUANT_A=False, INTERPRET=False,
            ROUND_BF16=False, DOT_PREC="tf32", COMBINE=not gated, ROUTING=fused_moe.SLOT_BLOCKS.value, BLOCK_S=16,
            BLOCK_E=16, TOP_K=8 if not gated else 1, BLOCK_T=8, GROUP_N=128, GROUP_K=128, TILE_N=32 if gated else 64,
            BLOCK_SIZE_M=16, BLOCK_SIZE_K=128, GROUP_SIZE_M=1, NORM_OUT=not gated, BLOCK_D=2048, PDL=True,
            AR_WORLD=1, SHARED_PREFETCH=prefetch, ELT_BYTES=2), 2 if gated else 4)

    def router(early):
        return compiled(moe_topk._moe_route_kernel, dict(
            TOP_K=6, TOPK_GROUP=1, METHOD=0, SIGMOID=False, NORM=False, HAS_BIAS=False, N_SHARED=2, BLOCK_G=1,
            BLOCK_PG=64, BLOCK_K=8, HAS_MASK=False, BLOCK_E=2, BLOCK_H=2048, NORM_IN=True, ONE_TILE=True, PDL=True,
            AR_WORLD=1, EARLY_RELEASE=early), 4)

    parts = [moe(True, True), moe(True, False), moe(False, True), router(True), router(False)]
    sys.stdout.write("\\n=== next ===\\n".join(parts))
""")


def _first(ptx: str, op: str) -> int:
    """Line of the first instruction starting with `op` (-1: none)."""
    return next((i for i, ln in enumerate(ptx.splitlines()) if ln.strip().startswith(op)), -1)


def test_prefetch_before_the_wait_and_early_release():
    out = compile_output(SCRIPT)
    gate_up, down, plain, early, late = out.split("\n=== next ===\n")
    for name, ptx in (("gate_up", gate_up), ("down", down)):
        fetch, wait = _first(ptx, "prefetch.global.L2::evict_last"), _first(ptx, "griddepcontrol.wait")
        assert 0 <= fetch < wait, f"{name}: the L2 prefetch (line {fetch}) must come before the PDL wait ({wait})"
    assert _first(plain, "prefetch.global") == -1, "no prefetch without SHARED_PREFETCH"
    release, wait = _first(early, "griddepcontrol.launch_dependents"), _first(early, "griddepcontrol.wait")
    assert 0 <= release < wait, f"the early release (line {release}) must come before the router's wait ({wait})"
    assert _first(late, "griddepcontrol.launch_dependents") == -1, "the router releases at exit without it"
