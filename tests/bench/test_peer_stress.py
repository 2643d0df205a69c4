"""`benchmarks/peer_stress.py` (the peer kernels in a decode's order, for the GPUs) runs end to end on two CPU
ranks at toy sizes, both with the in-kernel sums and with the push kernel: the script the next GPU run needs works."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("sums", ["1", "0"])
def test_peer_stress_runs_on_two_cpu_ranks(sums: str):
    env = dict(os.environ, TRITON_INTERPRET="1")
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "peer_stress.py"), "--device", "cpu",
                          "--hidden", "64", "--experts", "8", "--inter", "32", "--top-k", "2", "--layers", "2",
                          "--steps", "2", "--sums", sums], capture_output=True, text=True, timeout=600, env=env,
                         cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ok: every phase finished on both ranks" in out.stdout, out.stdout
    assert out.stdout.count("bs64:") == 2, out.stdout                # both rounds reached the last phase
