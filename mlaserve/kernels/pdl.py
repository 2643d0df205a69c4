"""Programmatic dependent launch (PDL, Hopper and later) for the decode path's Triton kernels.

A decode step at batch 1 is ~250 short kernels (benchmarks/results/decode-fold-h100.md); between two of them the
GPU drains the first, then launches and ramps up the second. Launched with PDL, a kernel's programs may start
before the previous kernel ends: they read what no kernel writes (weights) at once, then wait for it.

Every PDL kernel here keeps this order in every program:

    weight loads only | pdl_enter: wait until the previous kernel completed | the work | pdl_release | epilogue
                                                                            (the next kernel may launch from here)

- Every program passes `pdl_enter` before it reads an activation or writes anything, so a kernel completes only
  after the one before it. Kernels launched without PDL (cuBLAS, torch) after it see everything before them
  completed, as usual.
- A program without `pdl_release` releases the next kernel when it exits.
- The release sits after the main loop. Releasing at each program's start gained less on the H100 (V2-Lite bs 1:
  2.86 ms of GPU time a step, against 2.71 ms with the release after the loop and 2.87 ms without PDL;
  benchmarks/results/pdl-h100.md).

`MLASERVE_PDL=0` turns it off (A/B runs: benchmarks/gpu_pdl.sh). It is always off on the CPU (the interpreter has
no griddepcontrol) and below compute capability 9.0.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra import cuda as tlc


@triton.jit
def pdl_enter(PDL: tl.constexpr):
    """Wait until the previous kernel completed, with its writes visible."""
    if PDL:
        tlc.gdc_wait()


@triton.jit
def pdl_release(PDL: tl.constexpr):
    """Let the next kernel launch once every program of this one got here (or exited)."""
    if PDL:
        tlc.gdc_launch_dependents()


def enabled() -> bool:
    return os.environ.get("MLASERVE_PDL", "1") != "0"


@functools.lru_cache(maxsize=None)
def _supported(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def active(device: torch.device) -> bool:
    """Whether the kernels launched on `device` use PDL."""
    return device.type == "cuda" and enabled() and _supported(device.index if device.index is not None
                                                              else torch.cuda.current_device())


def pdl_meta(device: torch.device) -> dict:
    """The launch keywords of a PDL kernel on `device`: its PDL constexpr and Triton's launch_pdl option."""
    on = active(device)
    return dict(PDL=on, launch_pdl=on)
