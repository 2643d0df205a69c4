"""Benchmark cases for `mlaserve bench kernels`, one module per kernel.

Each module exposes `cases(ceil: Ceilings, quick: bool) -> Iterator[dict]`; each row has keys
kernel, shape, ms, tbps, tflops, bound ("bw" | "bf16" | "fp8"), frac (of that ceiling),
target (fraction or None), err (max rel. error vs `_ref` at this shape), ok (err within tolerance).
"""
