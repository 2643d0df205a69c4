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


@pytest.fixture
def one_thread():
    """torch on one intra-op thread for the test: small ops on a loaded 2-core machine run many times faster
    (spinning OpenMP threads wait for a core the other processes hold)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
