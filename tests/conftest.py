"""Test setup: Triton kernels run under the CPU interpreter when no GPU is present."""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # NOTE: must be set before any `triton.jit` decorator runs (i.e. before mlaserve.kernels imports).
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    skip_multi = pytest.mark.skip(reason="needs two or more CUDA GPUs")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)
        if "multi_gpu" in item.keywords and torch.cuda.device_count() < 2:
            item.add_marker(skip_multi)


@pytest.fixture
def device() -> str:
    return "cuda" if HAS_CUDA else "cpu"
