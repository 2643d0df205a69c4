"""The Triton interpreter's device-function calls without repatching (mlaserve/kernels/interpreter.py): the same
bits as the interpreter as shipped, with triton.language patched once per launch instead of once per helper call."""
from __future__ import annotations

import pytest
import torch

from mlaserve.kernels import interpreter
from mlaserve.kernels.fused_moe import fused_moe
from test_fused_moe import FP8_CFG, V3, fp8_weights, routing   # this folder's module (not the `kernels` package)

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU runs the kernels compiled")


def _run_counting(monkeypatch, case) -> tuple[torch.Tensor, int]:
    from triton.runtime import interpreter as ti

    calls = []
    patch_builtin = ti._patch_builtin
    monkeypatch.setattr(ti, "_patch_builtin", lambda *a: calls.append(1) or patch_builtin(*a))
    x, w, topk_weights, topk_ids = case
    out = fused_moe(x, **w, topk_weights=topk_weights, topk_ids=topk_ids, config=FP8_CFG)
    return out, len(calls)


def test_device_calls_skip_repatching_and_change_no_bit(monkeypatch):
    """Block-FP8 fused MoE (helpers called in every K step: the MAC, the activations' quantisation): bit for bit
    the shipped interpreter's output, with a fraction of its patching."""
    seed = int(torch.randint(0, 2**31, ()).item())
    print(f"seed {seed}")
    torch.manual_seed(seed)
    topk_weights, topk_ids = routing(3, V3, "cpu")
    case = (torch.randn(3, V3.hidden, dtype=torch.float16), fp8_weights(V3, "cpu"), topk_weights, topk_ids)
    assert interpreter.install()                     # conftest set TRITON_INTERPRET=1
    fast, fast_patches = _run_counting(monkeypatch, case)
    interpreter.uninstall()
    try:
        shipped, shipped_patches = _run_counting(monkeypatch, case)
    finally:
        assert interpreter.install()
    assert torch.equal(fast, shipped)
    assert 0 < 4 * fast_patches < shipped_patches, (fast_patches, shipped_patches)
