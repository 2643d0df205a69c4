"""mlaserve/env.py: the process-wide switches and the stack dumps every mlaserve process installs."""
from __future__ import annotations

import os
import subprocess
import sys


def test_ranks_print_their_stacks_on_sigusr1():
    """`kill -USR1` on a rank (what `gpu_tp.sh` sends a run that does not finish) prints where every thread of it
    is, and the rank goes on."""
    code = ("import os, signal, time\n"
            "from mlaserve.env import install_stack_dumps\n"
            "def waiting_in_a_collective():\n"
            "    os.kill(os.getpid(), signal.SIGUSR1); time.sleep(0.2); print('went on')\n"
            "install_stack_dumps()\n"
            "waiting_in_a_collective()\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "went on", out
    assert "waiting_in_a_collective" in out.stderr, out.stderr


def test_ranks_print_their_stacks_every_few_seconds_when_asked():
    """MLASERVE_DUMP_STACKS_EVERY=S: a process prints its stacks every S seconds unasked (a device run's ranks that
    no signal reaches); a value that is not a number is one error."""
    code = ("import time\n"
            "from mlaserve.env import install_stack_dumps\n"
            "def stuck_somewhere():\n"
            "    time.sleep(1.3)\n"
            "install_stack_dumps()\n"
            "stuck_somewhere()\n")
    env = {**os.environ, "MLASERVE_DUMP_STACKS_EVERY": "0.4"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out
    assert out.stderr.count("stuck_somewhere") >= 2, out.stderr
    env["MLASERVE_DUMP_STACKS_EVERY"] = "soon"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode != 0 and "MLASERVE_DUMP_STACKS_EVERY='soon': expected seconds" in out.stderr, out.stderr
