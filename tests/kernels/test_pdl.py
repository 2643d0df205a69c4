"""kernels/pdl.py: when the Triton kernels launch with programmatic dependent launch."""
from __future__ import annotations

import pytest
import torch

from mlaserve.kernels import pdl


def test_off_on_the_cpu_and_under_mlaserve_pdl_0(monkeypatch: pytest.MonkeyPatch) -> None:
    assert pdl.pdl_meta(torch.device("cpu")) == {"PDL": False, "launch_pdl": False}   # the interpreter: never
    monkeypatch.setenv("MLASERVE_PDL", "0")
    assert not pdl.enabled()
    monkeypatch.setenv("MLASERVE_PDL", "1")
    assert pdl.enabled()
    monkeypatch.delenv("MLASERVE_PDL")
    assert pdl.enabled()                                   # on by default where the GPU has it


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_it_follows_the_compute_capability(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLASERVE_PDL", raising=False)
    hopper = torch.cuda.get_device_capability()[0] >= 9
    assert pdl.pdl_meta(torch.device("cuda")) == {"PDL": hopper, "launch_pdl": hopper}
    monkeypatch.setenv("MLASERVE_PDL", "0")
    assert pdl.pdl_meta(torch.device("cuda")) == {"PDL": False, "launch_pdl": False}
