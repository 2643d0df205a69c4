"""Process-wide MLASERVE_* switches, read and checked here (a bad value is one error naming the variable).

The kernels' 0 / 1 A/B switches are read through `on_off` where they act (MLASERVE_GEMV1, MLASERVE_SHARED_IN_ROUTER,
MLASERVE_MLA_CHAIN); the others (MLASERVE_PDL, MLASERVE_PAD_MASK, MLASERVE_PEER_PUSH, MLASERVE_KERNEL_SUMS,
MLASERVE_PEER_MAX_BYTES) are still read on their own.
Torch-free: the CLI and the HTTP process import it too.
"""
from __future__ import annotations

import faulthandler
import os
import signal
import sys


def on_off(name: str, default: bool) -> bool:
    """A 0 / 1 switch: True for "1", False for "0", `default` when unset; any other value is one error."""
    v = os.environ.get(name, "1" if default else "0")
    if v not in ("0", "1"):
        raise ValueError(f"{name}={v!r}: expected 0 or 1")
    return v == "1"


def dump_stacks_every() -> float | None:
    """MLASERVE_DUMP_STACKS_EVERY=S: seconds between unasked stack dumps (unset or empty: none)."""
    every = os.environ.get("MLASERVE_DUMP_STACKS_EVERY")
    if not every:
        return None
    try:
        return float(every)
    except ValueError:
        raise ValueError(f"MLASERVE_DUMP_STACKS_EVERY={every!r}: expected seconds") from None


def install_stack_dumps() -> None:
    """`kill -USR1 PID` prints every thread's Python stack of this process to stderr (where a rank waits when a
    collective or a spinning all-reduce never returns); the process goes on. With MLASERVE_DUMP_STACKS_EVERY=S
    (seconds, for device runs that may stop) it also prints them every S seconds, unasked: a signal reaches only
    the processes a script can find. Every mlaserve process calls it: the CLI, the scheduler ranks, spawned ranks."""
    if sys.__stderr__ is None:        # (sys.stderr may be a stand-in without a file descriptor, e.g. under pytest)
        return
    faulthandler.register(signal.SIGUSR1, file=sys.__stderr__, all_threads=True)
    every = dump_stacks_every()
    if every is not None:
        faulthandler.dump_traceback_later(every, repeat=True, file=sys.__stderr__)
